"""Kernel libraries a target's runtime provides, and which ops each takes.

A target lists its libraries (`TargetSpec.libraries`); the middle end asks the spec whether a
library takes an op (`TargetSpec.library_for`) instead of asking which target it is. What a
library's calls look like in Relax is the business of the pass that dispatches to it
(`relax_passes.library_dispatch`) and of kernel selection's library source.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from ..runtime.libraries import CPU_LIBRARY as CPU_RUNTIME
from ..runtime.libraries import CUDA_LIBRARY as CUDA_RUNTIME


@dataclasses.dataclass(frozen=True)
class KernelLibrary:
    """A library of kernels callable from a compiled model.

    name: the prefix of its packed functions (`"gimlet.cpu"` for `gimlet.cpu.matmul`).
    ops: op kind (`"matmul"`, `"conv2d"`, `"attention"`) -> element types it takes.
    source: where its code lives, for tables and provenance.
    runtime: the runtime extension that registers its functions (`runtime.libraries`).
    """

    name: str
    ops: Mapping[str, tuple[str, ...]]
    source: str
    runtime: str

    def takes(self, op: str, dtype: str) -> bool:
        return dtype in self.ops.get(op, ())


# gimlet's CPU runtime extension (runtime/ext/cpu_library.cc): matmul and conv2d through
# OpenBLAS, its own direct conv2d and blocked attention; compiled on the machine that runs the
# model.
CPU_LIBRARY = KernelLibrary(
    "gimlet.cpu",
    {"matmul": ("float32",), "conv2d": ("float32",), "attention": ("float32",)},
    "runtime/ext/cpu_library.cc (OpenBLAS)",
    CPU_RUNTIME,
)

# gimlet's CUDA runtime extension (runtime/ext/cuda_library.cc): cuBLAS's SGEMM.
CUDA_LIBRARY = KernelLibrary("gimlet.cuda", {"matmul": ("float32",)}, "runtime/ext/cuda_library.cc (cuBLAS)",
                             CUDA_RUNTIME)
