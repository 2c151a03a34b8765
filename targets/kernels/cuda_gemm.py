"""CUDA GEMM: C[M, N] = A[M, K] @ B[K, N], float32, shared-memory tiled.

A 16 x 16 thread block computes a 16 x 16 tile of C; it walks K in steps of 16, each thread
loading one element of the A and of the B tile into shared memory (zero beyond the edges,
so any M, N, K works), then accumulating 16 products from shared memory.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

TILE = 16


def cuda_gemm(m: int, n: int, k: int) -> tvm.tirx.PrimFunc:
    """The kernel for fixed M, N, K."""
    grid_m, grid_n, steps = (m + TILE - 1) // TILE, (n + TILE - 1) // TILE, (k + TILE - 1) // TILE

    @T.prim_func
    def gemm(a: T.Buffer((m, k), "float32"), b: T.Buffer((k, n), "float32"),
             c: T.Buffer((m, n), "float32")):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        by = T.launch_thread("blockIdx.y", grid_m)
        bx = T.launch_thread("blockIdx.x", grid_n)
        ty = T.launch_thread("threadIdx.y", TILE)
        tx = T.launch_thread("threadIdx.x", TILE)
        a_tile = T.decl_buffer((TILE, TILE), "float32", scope="shared")
        b_tile = T.decl_buffer((TILE, TILE), "float32", scope="shared")
        acc = T.decl_buffer((1,), "float32", scope="local")
        row = by * TILE + ty
        col = bx * TILE + tx
        acc[0] = T.float32(0)
        for step in range(steps):
            a_tile[ty, tx] = T.if_then_else(row < m and step * TILE + tx < k,
                                            a[T.min(row, m - 1), T.min(step * TILE + tx, k - 1)],
                                            T.float32(0))
            b_tile[ty, tx] = T.if_then_else(step * TILE + ty < k and col < n,
                                            b[T.min(step * TILE + ty, k - 1), T.min(col, n - 1)],
                                            T.float32(0))
            T.tvm_storage_sync("shared")
            for kk in range(TILE):
                acc[0] = acc[0] + a_tile[ty, kk] * b_tile[kk, tx]
            T.tvm_storage_sync("shared")
        if row < m and col < n:
            c[row, col] = acc[0]

    return gemm
