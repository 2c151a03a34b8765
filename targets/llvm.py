"""LLVM CPU: the host processor, detected so vector code uses its widest ISA (AVX-512 here)."""

from __future__ import annotations

import functools
import os
from typing import Any

import tvm

from ..relax_passes.dispatch_cpu_library import DispatchCPULibrary
from ..runtime.extensions import load_extensions
from ..schedules.cpu import RULES as CPU_SCHEDULE_RULES
from .spec import PerfFacts, TargetSpec

# Main-memory bandwidth one socket's share of DDR4/DDR5 channels gives a few cores: an estimate.
HOST_MEMORY_GBPS = 20.0
DEFAULT_CLOCK_GHZ = 2.5

# Vector register width (bits) and count implied by the LLVM CPU features we recognise, widest
# first.
_VECTOR_REGISTERS = (("avx512f", 512, 32), ("avx2", 256, 16), ("avx", 256, 16), ("sse2", 128, 16),
                     ("neon", 128, 32))


def _num_cores() -> int:
    if "TVM_NUM_THREADS" in os.environ:
        return int(os.environ["TVM_NUM_THREADS"])
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@functools.lru_cache(maxsize=None)
def _host_cpu() -> str:
    return str(tvm.target.codegen.llvm_get_system_cpu())


@functools.lru_cache(maxsize=None)
def _vector_registers(mcpu: str) -> tuple[int, int]:
    """(bits, count) of the widest vector registers the CPU model has, from LLVM's own feature
    table (128-bit, 16 when none is recognised)."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    features = {str(f) for f in tvm.target.codegen.llvm_get_cpu_features(target)}
    return next(((bits, count) for feature, bits, count in _VECTOR_REGISTERS if feature in features), (128, 16))


def vector_bits(mcpu: str) -> int:
    """Widest vector width the CPU model supports."""
    return _vector_registers(mcpu)[0]


def vector_registers(mcpu: str) -> int:
    """How many of those vector registers it has (AVX-512 and NEON 32, AVX2 16)."""
    return _vector_registers(mcpu)[1]


def host_target() -> dict[str, Any]:
    """The TVM target for this machine's CPU: its model (`mcpu`) and core count."""
    return {"kind": "llvm", "mcpu": _host_cpu(), "num-cores": _num_cores()}


def host_facts() -> dict[str, Any]:
    mcpu = _host_cpu()
    return {"mcpu": mcpu, "vector_bits": vector_bits(mcpu), "cores": _num_cores()}


def _clock_ghz() -> float:
    """The CPU clock the kernel reports (first core), else a typical one."""
    try:
        with open("/proc/cpuinfo") as f:
            mhz = next(line for line in f if line.startswith("cpu MHz"))
        return float(mhz.split(":")[1]) / 1000
    except (OSError, StopIteration, ValueError):
        return DEFAULT_CLOCK_GHZ


def host_perf() -> PerfFacts:
    """Roofline of the host: cores x fp32 lanes x 2 (FMA) x 2 FMA ports x clock."""
    lanes = vector_bits(_host_cpu()) // 32
    peak = _num_cores() * lanes * 2 * 2 * _clock_ghz()
    return PerfFacts(peak_gflops=peak, memory_gbps=HOST_MEMORY_GBPS, launch_us=1, link_gbps=None,
                     copy_us=0)


LLVM_CPU = TargetSpec(
    name="llvm",
    aliases=("cpu", "x86", "host"),
    kind="llvm",
    description="host CPU through LLVM (vectorized for the detected CPU model)",
    default_target=host_target,
    device_type="cpu",
    extra_facts=host_facts,
    library_passes=lambda target: (DispatchCPULibrary(), tvm.relax.transform.FastMathTransform()),
    schedule_rules=lambda target: tuple(rule() for rule in CPU_SCHEDULE_RULES),
    can_run=lambda: None,
    load_runtime_library=load_extensions,
    perf_facts=host_perf,
)
