"""Hand-written kernels kept in the repo, by op and target kind: `KERNELS`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import tvm

from .cpu_gemm import cpu_gemm
from .cuda_gemm import cuda_gemm


@dataclasses.dataclass(frozen=True)
class HandwrittenKernel:
    """`make(M, N, K)`: the PrimFunc `(a[M, K], b[K, N], c[M, N])` for one GEMM shape."""

    name: str
    op: str
    target_kind: str
    make: Callable[[int, int, int], tvm.tirx.PrimFunc]
    file: str


_HERE = Path(__file__).resolve().parent
KERNELS = (
    HandwrittenKernel("cpu_gemm_4x32", "matmul", "llvm", cpu_gemm, str(_HERE / "cpu_gemm.py")),
    HandwrittenKernel("cuda_gemm_16x16", "matmul", "cuda", cuda_gemm, str(_HERE / "cuda_gemm.py")),
)
