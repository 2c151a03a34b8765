"""LLVM CPU: the host processor, detected so vector code uses its widest ISA (AVX-512 where it has it)."""

from __future__ import annotations

import functools
import platform
from typing import Any

import tvm

from .cpu_attention import replace_attention_kernels
from .cpu import CPU_KERNELS, cpu_default_kernel, cpu_perf, num_cores, vector_bits
from .libraries import CPU_LIBRARY
from .spec import PerfFacts, TargetSpec


# LLVM prefers 256-bit vectors on Intel's AVX-512 CPUs but 512-bit ones on AMD's (Zen 4, 5),
# and its 512-bit code for TVM's vectorized select between gathers reads the wrong elements
# (ONNX's RotaryEmbedding on 3-D input: garbage on znver4, right on every Intel mcpu and with
# this feature): x86 hosts get Intel's default everywhere.
_PREFER_256 = ("+prefer-256-bit",)


@functools.lru_cache(maxsize=None)
def _host_cpu() -> str:
    return str(tvm.target.codegen.llvm_get_system_cpu())


def host_target() -> dict[str, Any]:
    """The TVM target for this machine's CPU: its model (`mcpu`) and core count; on x86 CPUs
    with AVX-512, 256-bit vectors preferred (`_PREFER_256`)."""
    target: dict[str, Any] = {"kind": "llvm", "mcpu": _host_cpu(), "num-cores": num_cores()}
    if platform.machine() == "x86_64" and vector_bits(target) == 512:
        target["mattr"] = list(_PREFER_256)
    return target


def host_facts() -> dict[str, Any]:
    return {"mcpu": _host_cpu(), "vector_bits": vector_bits(host_target()), "cores": num_cores()}


def host_perf() -> PerfFacts:
    """Roofline of this machine's CPU."""
    return cpu_perf(host_target())


LLVM_CPU = TargetSpec(
    name="llvm",
    aliases=("cpu", "host"),
    kind="llvm",
    description="host CPU through LLVM (vectorized for the detected CPU model)",
    default_target=host_target,
    device_type="cpu",
    arch=platform.machine(),
    extra_facts=host_facts,
    libraries=(CPU_LIBRARY,),
    handwritten_kernels=CPU_KERNELS,
    fast_math=True,
    fix_library_kernels=replace_attention_kernels,
    can_run=lambda: None,
    perf_facts=host_perf,
    default_kernel=cpu_default_kernel,
)

TARGET = LLVM_CPU
