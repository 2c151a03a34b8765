"""Hand-written kernels kept in the repo, by op and target kind: `KERNELS`."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Callable

import tvm

from .cpu_gemm import MAX_ADDENDS, cpu_gemm
from .cuda_gemm import cuda_gemm

__all__ = ["KERNELS", "MAX_ADDENDS", "HandwrittenKernel"]


@dataclasses.dataclass(frozen=True)
class HandwrittenKernel:
    """`make(M, N, K, epilogue, addends)`: the PrimFunc `(a[M, K], b[K, N], addends...,
    c[M, N])` for one GEMM shape and epilogue (`OpSignature.epilogue`, `.addends_2d()`);
    a kernel that does not `fuses_epilogue` is only asked for groups without one."""

    name: str
    op: str
    target_kind: str
    make: Callable[..., tvm.tirx.PrimFunc]
    file: str
    fuses_epilogue: bool


def _no_epilogue(make: Callable[[int, int, int], tvm.tirx.PrimFunc]) -> Callable[..., tvm.tirx.PrimFunc]:
    return lambda m, n, k, epilogue, addends: make(m, n, k)


_HERE = Path(__file__).resolve().parent
KERNELS = (
    HandwrittenKernel("cpu_gemm_4x32", "matmul", "llvm", functools.partial(cpu_gemm, 4, 32, 1),
                      str(_HERE / "cpu_gemm.py"), fuses_epilogue=True),
    HandwrittenKernel("cpu_gemv_1x256", "matmul", "llvm", functools.partial(cpu_gemm, 1, 256, 4),
                      str(_HERE / "cpu_gemm.py"), fuses_epilogue=True),
    HandwrittenKernel("cuda_gemm_16x16", "matmul", "cuda", _no_epilogue(cuda_gemm),
                      str(_HERE / "cuda_gemm.py"), fuses_epilogue=False),
)
