"""CPU GEMM micro-kernel with a fused epilogue: C[M, N] = epilogue(A[M, K] @ B[K, N]), float32,
row-major.

Each parallel task owns a panel of `nr` columns (vectors of 8 AVX2 lanes) and walks down it
in blocks of `mr` rows, accumulating an mr x nr tile over all of K (`ku` rows of B per
accumulator update), then writes
the tile through the epilogue (bias / residual adds, ReLU, GELU, in the group's order) while it
is still in registers; the rows left over (M % mr) take the same walk one row at a time, and
the columns left over (N % nr) are one more panel computed with scalar loops. So any M, N, K
is handled without padding or masks.

Two shapes of it are kernels (`KERNELS`): a 4 x 32 register tile for GEMMs, and a GEMV one
for skinny M (batch 1, a few rows; memory-bound): one row at a time, each task streaming
long contiguous runs (256 columns) of B rows, 4 rows of B per update of its accumulator row
(which stays in L1), so B is read once per output row at close to memory bandwidth.
"""

from __future__ import annotations

import math

import tvm
from tvm.script import tirx as T

from ..candidates import Step

MAX_ADDENDS = 2  # epilogue adds a kernel takes (bias and residual of a transformer layer)


def _epilogue(value: tvm.tirx.PrimExpr, i, j, epilogue: tuple[Step, ...], addends) -> tvm.tirx.PrimExpr:
    """`value` (output element [i, j]) through the epilogue's steps; addend buffers are
    (rows, columns) with rows 1 or M and columns 1 or N (broadcast along the 1s)."""
    addends = iter(addends)
    for kind, _ in epilogue:
        if kind == "add":
            addend = next(addends)
            rows, cols = (int(d) for d in addend.shape)
            value = value + addend[i if rows > 1 else 0, j if cols > 1 else 0]
        elif kind == "relu":
            value = T.max(value, T.float32(0))
        else:  # gelu
            value = T.float32(0.5) * value * (T.float32(1) + T.erf(value * T.float32(1 / math.sqrt(2))))
    return value


def _dot(a, b, row, col, k0, ku: int) -> tvm.tirx.PrimExpr:
    """a[row, k0 : k0 + ku] . b[k0 : k0 + ku, col], written out (one accumulator update)."""
    return sum((a[row, k0 + u] * b[k0 + u, col] for u in range(1, ku)), a[row, k0] * b[k0, col])


def cpu_gemm(mr: int, nr: int, ku: int, m: int, n: int, k: int, epilogue: tuple[Step, ...],
             addends: list[tuple[int, int]]) -> tvm.tirx.PrimFunc:
    """The kernel with an mr x nr tile, K unrolled by ku, for fixed M, N, K (tails included)
    and epilogue; `addends`: each epilogue addend's (rows, columns), the PrimFunc's parameters
    after b."""
    full_m, full_n, full_k = m // mr * mr, n // nr * nr, k // ku * ku

    @T.macro
    def body(a, b, c, extra):
        for panel in T.parallel(n // nr):
            acc = T.decl_buffer((mr, nr), "float32", scope="local")
            row = T.decl_buffer((nr,), "float32", scope="local")
            for block in range(m // mr):
                for i in T.unroll(mr):
                    for j in T.vectorized(nr):
                        acc[i, j] = T.float32(0)
                for kk in range(k // ku):
                    for i in T.unroll(mr):
                        for j in T.vectorized(nr):
                            acc[i, j] = acc[i, j] + _dot(a, b, block * mr + i, panel * nr + j, kk * ku, ku)
                for kk in range(k - full_k):
                    for i in T.unroll(mr):
                        for j in T.vectorized(nr):
                            acc[i, j] = acc[i, j] + a[block * mr + i, full_k + kk] * b[full_k + kk, panel * nr + j]
                for i in T.unroll(mr):
                    for j in T.vectorized(nr):
                        c[block * mr + i, panel * nr + j] = _epilogue(
                            acc[i, j], block * mr + i, panel * nr + j, epilogue, extra)
            for r in range(m - full_m):
                for j in T.vectorized(nr):
                    row[j] = T.float32(0)
                for kk in range(k):
                    for j in T.vectorized(nr):
                        row[j] = row[j] + a[full_m + r, kk] * b[kk, panel * nr + j]
                for j in T.vectorized(nr):
                    c[full_m + r, panel * nr + j] = _epilogue(row[j], full_m + r, panel * nr + j, epilogue, extra)
        for r, j in T.grid(m, n - full_n):
            c[r, full_n + j] = T.float32(0)
            for kk in range(k):
                c[r, full_n + j] = c[r, full_n + j] + a[r, kk] * b[kk, full_n + j]
            c[r, full_n + j] = _epilogue(c[r, full_n + j], r, full_n + j, epilogue, extra)

    # One signature per number of addends (TVMScript parameters are written out).
    if not addends:
        @T.prim_func
        def gemm(a: T.Buffer((m, k), "float32"), b: T.Buffer((k, n), "float32"),
                 c: T.Buffer((m, n), "float32")):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            body(a, b, c, ())
    elif len(addends) == 1:
        @T.prim_func
        def gemm(a: T.Buffer((m, k), "float32"), b: T.Buffer((k, n), "float32"),
                 e0: T.Buffer(addends[0], "float32"), c: T.Buffer((m, n), "float32")):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            body(a, b, c, (e0,))
    else:
        @T.prim_func
        def gemm(a: T.Buffer((m, k), "float32"), b: T.Buffer((k, n), "float32"),
                 e0: T.Buffer(addends[0], "float32"), e1: T.Buffer(addends[1], "float32"),
                 c: T.Buffer((m, n), "float32")):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            body(a, b, c, (e0, e1))

    return gemm
