"""Hand-written kernels kept in the repo, by op and target kind: `KERNELS`."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Callable

import tvm

from ....targets.llvm import vector_bits, vector_registers
from ..candidates import Step
from .cpu_gemm import MAX_ADDENDS, cpu_gemm, cpu_gemv, packed_shape
from .cuda_gemm import cuda_gemm

__all__ = ["KERNELS", "MAX_ADDENDS", "HandwrittenKernel"]


@dataclasses.dataclass(frozen=True)
class HandwrittenKernel:
    """`make(target, M, N, K, epilogue, addends)`: the PrimFunc `(a[M, K], b[K, N], addends...,
    c[M, N])` for one GEMM shape and epilogue (`OpSignature.epilogue`, `.addends_2d()`) on
    `target`; a kernel that does not `fuses_epilogue` is only asked for groups without one.
    `packed_b(target, N, K)`: for a kernel that takes B packed (only offered where B is a
    constant weight, so the packing is folded at build time), the packed shape; B[K, N] is
    padded to it along N and laid out as [panels, K, panel width]."""

    name: str
    op: str
    target_kind: str
    make: Callable[..., tvm.tirx.PrimFunc]
    file: str
    fuses_epilogue: bool
    packed_b: Callable[[tvm.target.Target, int, int], tuple[int, int, int]] | None = None

    def prim_func(self, target: tvm.target.Target, m: int, n: int, k: int,
                  epilogue: tuple[Step, ...], addends: list[tuple[int, int]]) -> tvm.tirx.PrimFunc:
        """`make`'s PrimFunc, made once per target, shape and epilogue in a process: parsing
        the TVMScript takes about half a second, and a model repeats its layers' shapes (a
        cold timing builds 64 copies of one group)."""
        return _made(self, str(target), m, n, k, tuple(epilogue), tuple(addends))


@functools.lru_cache(maxsize=256)
def _made(kernel: HandwrittenKernel, target_json: str, m: int, n: int, k: int,
          epilogue: tuple[Step, ...], addends: tuple[tuple[int, int], ...]) -> tvm.tirx.PrimFunc:
    """`kernel.make` on hashable arguments (the target as its JSON text)."""
    return kernel.make(tvm.target.Target(json.loads(target_json)), m, n, k, epilogue, list(addends))


_HERE = Path(__file__).resolve().parent


def _cores(target: tvm.target.Target) -> int:
    return int(target.attrs.get("num-cores", 1))


def _two_vectors(target: tvm.target.Target) -> int:
    """Panel width of the CPU GEMMs: two of the target's float32 vectors."""
    return 2 * vector_bits(str(target.attrs.get("mcpu", ""))) // 32


def _tallest_tile(target: tvm.target.Target) -> int:
    """Rows of the tallest mr x 2-vector tile the vector registers hold: 2 per row, plus 2 for
    B's vectors and 1 for the broadcast of A."""
    return (vector_registers(str(target.attrs.get("mcpu", ""))) - 3) // 2


def _cpu_gemm(mr: int | None, packed: bool) -> HandwrittenKernel:
    """`cpu_gemm[_packed]_{mr}x2v`: tiles of at most mr x (2 vectors) (`cpu_gemm.cpu_gemm`);
    mr None: `_tallest_tile` (`cpu_gemm_packed_tallx2v`)."""
    return HandwrittenKernel(
        f"cpu_gemm{'_packed' if packed else ''}_{mr or 'tall'}x2v", "matmul", "llvm",
        lambda target, *group: cpu_gemm(mr or _tallest_tile(target), _two_vectors(target), packed, *group),
        str(_HERE / "cpu_gemm.py"), fuses_epilogue=True,
        packed_b=(lambda target, n, k: packed_shape(n, k, _two_vectors(target))) if packed else None,
    )


KERNELS = (
    _cpu_gemm(6, packed=False),
    _cpu_gemm(4, packed=True),
    _cpu_gemm(None, packed=True),
    HandwrittenKernel("cpu_gemv_k4", "matmul", "llvm",
                      lambda target, *group: cpu_gemv(4, _cores(target), *group),
                      str(_HERE / "cpu_gemm.py"), fuses_epilogue=True),
    HandwrittenKernel("cuda_gemm_16x16", "matmul", "cuda", lambda target, m, n, k, *epilogue: cuda_gemm(m, n, k),
                      str(_HERE / "cuda_gemm.py"), fuses_epilogue=False),
)
