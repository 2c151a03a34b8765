"""What a benchmark's report says of the machine and the software: the CPU's name and the
versions of the packages that were measured."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Iterable


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def versions(packages: Iterable[str]) -> dict[str, str | None]:
    """Each package's installed version (None: not installed)."""
    out = {}
    for package in packages:
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = None
    return out
