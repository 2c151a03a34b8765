"""Memory a model needs against memory the machine has: refuse up front, not by the OOM killer.

Callers estimate what a model's declared sizes need (`Need`: its weights and the most that
one step must hold at once; a lower bound, so a model that would fit is never refused) and
call `require`; it raises `ResourceLimitError` naming the figure, what is available and the
biggest part.

Available is the least of this machine's physical memory, the kernel's `MemAvailable`
(free memory and what it can reclaim) and, in a container, the cgroup's limit less its
usage. `GIMLET_TVM_MEMORY_LIMIT` overrides it: a byte count (suffixes K, M, G, T: powers of
1024) or `off` to skip the check.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from .errors import GimletError, ResourceLimitError

ENV = "GIMLET_TVM_MEMORY_LIMIT"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_CGROUP = "/sys/fs/cgroup"


@dataclass
class Need:
    """What a model needs: `parts` (name -> bytes) held all the time, such as weights, and
    `peak`, the largest amount one step holds besides them (bytes, which step); `biggest`:
    the largest single tensor (description, bytes), for the message."""

    parts: dict[str, int] = field(default_factory=dict)
    peak: tuple[int, str] = (0, "")
    biggest: tuple[str, int] = ("", 0)

    @property
    def total(self) -> int:
        return sum(self.parts.values()) + self.peak[0]

    def add_peak(self, size: int, what: str) -> None:
        """Note a step holding `size` bytes at once; the largest is kept."""
        if size > self.peak[0]:
            self.peak = (size, what)

    def note(self, what: str, size: int) -> None:
        """Note a tensor; the largest is kept."""
        if size > self.biggest[1]:
            self.biggest = (what, size)


def format_bytes(size: int | float) -> str:
    """`size` in the largest binary unit that keeps it at least 1 (`1.5 GiB`)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _override() -> int | None | str:
    """The environment's limit in bytes, "off", or None when unset."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    if text.lower() == "off":
        return "off"
    match = re.fullmatch(r"(\d+)\s*([KMGT]?)I?B?", text.upper())
    if not match:
        raise GimletError(f"{ENV} must be a byte count (e.g. 512M, 16G) or 'off', got '{text}'")
    return int(match[1]) * _UNITS[match[2]]


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_available() -> int | None:
    """The cgroup's limit less its usage (v2, else v1), None without a limit."""
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        cap = _read_int(os.path.join(_CGROUP, limit))
        if cap is not None and cap < 1 << 60:  # v1 writes a huge number for "no limit"
            return max(0, cap - (_read_int(os.path.join(_CGROUP, usage)) or 0))
    return None


def available_memory() -> tuple[int, str] | None:
    """(bytes, where the figure comes from) this process may still use; None when the check
    is off (`GIMLET_TVM_MEMORY_LIMIT=off`)."""
    override = _override()
    if override == "off":
        return None
    if override is not None:
        return override, f"{ENV}={os.environ[ENV].strip()}"
    figures = [(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical memory")]
    meminfo = _meminfo_available()
    if meminfo is not None:
        figures.append((meminfo, "MemAvailable"))
    cgroup = _cgroup_available()
    if cgroup is not None:
        figures.append((cgroup, "the cgroup's memory limit less its usage"))
    return min(figures)


def require(need: Need, what: str) -> None:
    """Raise `ResourceLimitError` when `need` is more than the memory available; `what`
    names the model and the step ("compiling model.onnx")."""
    available = available_memory()
    if available is None or need.total <= available[0]:
        return
    parts = [f"{key} {format_bytes(value)}" for key, value in need.parts.items()]
    if need.peak[0]:
        parts.append(f"{need.peak[1]} {format_bytes(need.peak[0])}")
    biggest = f"; the biggest tensor: {need.biggest[0]}, {format_bytes(need.biggest[1])}" if need.biggest[1] else ""
    raise ResourceLimitError(
        f"{what} needs at least {format_bytes(need.total)} ({need.total} bytes) of memory, "
        f"{format_bytes(available[0])} available ({available[1]}): {', '.join(parts)}{biggest}. "
        f"Set {ENV}=off to skip this check."
    )
