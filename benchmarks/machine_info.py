"""What a benchmark's report says of the machine and the software: the CPU's name, the
versions of the packages that were measured, and how busy other processes keep the CPUs
(`wait_idle` waits for a quiet machine on a shared host)."""

from __future__ import annotations

import os
import platform
import resource
import time
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


def cpu_seconds() -> tuple[float, float, float]:
    """(wall clock, busy CPU seconds of the whole machine, CPU seconds of this process and its
    waited-for children, i.e. the workers)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    ours = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        ours += usage.ru_utime + usage.ru_stime
    return time.perf_counter(), busy, ours


def other_load(before: tuple, after: tuple) -> float | None:
    """Cores kept busy by other processes than this one and its workers, on average between
    ``before`` and ``after`` (from `cpu_seconds`)."""
    wall = after[0] - before[0]
    if wall <= 0:
        return None
    return max(0.0, ((after[1] - before[1]) - (after[2] - before[2])) / wall)


def wait_idle(limit_s: float, window_s: float = 5.0, threshold: float = 0.25) -> float | None:
    """Wait until other processes keep under ``threshold`` cores busy for two windows in a
    row, at most ``limit_s`` seconds; returns the load of the last window."""
    deadline, quiet, load = time.monotonic() + limit_s, 0, None
    while time.monotonic() < deadline and quiet < 2:
        before = cpu_seconds()
        time.sleep(window_s)
        load = other_load(before, cpu_seconds())
        quiet = quiet + 1 if load is not None and load < threshold else 0
    return load
