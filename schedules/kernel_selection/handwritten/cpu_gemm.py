"""CPU GEMM micro-kernel: C[M, N] = A[M, K] @ B[K, N], float32, row-major.

Each parallel task owns a panel of `NR` columns (two AVX-512 vectors) and walks down it in
blocks of `MR` rows, accumulating an MR x NR tile in registers over all of K; the rows left
over (M % MR) take the same walk one row at a time, and the columns left over (N % NR) are one
more panel computed with scalar loops. So any M, N, K is handled without padding or masks.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

MR = 4
NR = 32


def cpu_gemm(m: int, n: int, k: int) -> tvm.tirx.PrimFunc:
    """The kernel for fixed M, N, K (tails included)."""
    full_m, full_n = m // MR * MR, n // NR * NR

    @T.prim_func
    def gemm(a: T.Buffer((m, k), "float32"), b: T.Buffer((k, n), "float32"),
             c: T.Buffer((m, n), "float32")):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        for panel in T.parallel(n // NR):
            acc = T.decl_buffer((MR, NR), "float32", scope="local")
            row = T.decl_buffer((NR,), "float32", scope="local")
            for block in range(m // MR):
                for i in T.unroll(MR):
                    for j in T.vectorized(NR):
                        acc[i, j] = T.float32(0)
                for kk in range(k):
                    for i in T.unroll(MR):
                        for j in T.vectorized(NR):
                            acc[i, j] = acc[i, j] + a[block * MR + i, kk] * b[kk, panel * NR + j]
                for i in T.unroll(MR):
                    for j in T.vectorized(NR):
                        c[block * MR + i, panel * NR + j] = acc[i, j]
            for r in range(m - full_m):
                for j in T.vectorized(NR):
                    row[j] = T.float32(0)
                for kk in range(k):
                    for j in T.vectorized(NR):
                        row[j] = row[j] + a[full_m + r, kk] * b[kk, panel * NR + j]
                for j in T.vectorized(NR):
                    c[full_m + r, panel * NR + j] = row[j]
        for r, j in T.grid(m, n - full_n):
            c[r, full_n + j] = T.float32(0)
            for kk in range(k):
                c[r, full_n + j] = c[r, full_n + j] + a[r, kk] * b[kk, full_n + j]

    return gemm
