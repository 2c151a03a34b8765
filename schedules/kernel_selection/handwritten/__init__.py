"""Hand-written kernels kept in the repo, by op and target kind: `KERNELS`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import tvm

from .cpu_gemm import MAX_ADDENDS, cpu_gemm, cpu_gemv
from .cuda_gemm import cuda_gemm

__all__ = ["KERNELS", "MAX_ADDENDS", "HandwrittenKernel"]


@dataclasses.dataclass(frozen=True)
class HandwrittenKernel:
    """`make(target, M, N, K, epilogue, addends)`: the PrimFunc `(a[M, K], b[K, N], addends...,
    c[M, N])` for one GEMM shape and epilogue (`OpSignature.epilogue`, `.addends_2d()`) on
    `target`; a kernel that does not `fuses_epilogue` is only asked for groups without one."""

    name: str
    op: str
    target_kind: str
    make: Callable[..., tvm.tirx.PrimFunc]
    file: str
    fuses_epilogue: bool


def _cores(target: tvm.target.Target) -> int:
    return int(target.attrs.get("num-cores", 1))


_HERE = Path(__file__).resolve().parent
KERNELS = (
    HandwrittenKernel("cpu_gemm_4x32", "matmul", "llvm", lambda target, *group: cpu_gemm(4, 32, *group),
                      str(_HERE / "cpu_gemm.py"), fuses_epilogue=True),
    HandwrittenKernel("cpu_gemv_k4", "matmul", "llvm",
                      lambda target, *group: cpu_gemv(4, _cores(target), *group),
                      str(_HERE / "cpu_gemm.py"), fuses_epilogue=True),
    HandwrittenKernel("cuda_gemm_16x16", "matmul", "cuda", lambda target, m, n, k, *epilogue: cuda_gemm(m, n, k),
                      str(_HERE / "cuda_gemm.py"), fuses_epilogue=False),
)
