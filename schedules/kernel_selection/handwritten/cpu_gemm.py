"""CPU GEMM and GEMV kernels with a fused epilogue: C[M, N] = epilogue(A[M, K] @ B[K, N]),
float32, row-major.

`cpu_gemm`: each parallel task owns a panel of `nr` columns (two vector registers) and walks
down it `mr` rows at a time, accumulating an mr x nr tile over all of K in registers, then
writes the tile through the epilogue (bias / residual adds, ReLU, GELU, in the group's order);
the last M % mr rows are one shorter tile, the last N % nr columns one more, zero-padded
panel. With `packed`, B comes as `packed_shape` panels (built from a constant weight at build
time): each panel is one contiguous run read in order, where row-major B makes every step of
K touch another page. 6 x 2 vectors fills AVX2's 16 registers (12 accumulators, 2 B vectors,
1 broadcast A value); 4 x 2 leaves room to spare.

`cpu_gemv` is the kernel for skinny M (batch 1, a few rows; memory-bound): one output row at
a time, the columns split in one run per core, each task streaming long contiguous runs of
B's rows, 4 rows of B per update of its accumulator row (which stays in L1), so B is read
once per output row, with no packing.
"""

from __future__ import annotations

import math

import tvm
from tvm.script import tirx as T

from ..candidates import Step

MAX_ADDENDS = 2  # epilogue adds a kernel takes (bias and residual of a transformer layer)
VECTOR = 32  # lanes of the GEMV's vector loops (4 AVX2 registers)


# erf(x) ~ x P(x^2) / Q(x^2) on x clamped to [-4, 4] (TVM's fast_erf, from Eigen; |error| <
# 4.3e-7 in float32): LLVM has no vector erf, so T.erf costs one libm call per element.
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
          -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
          -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
          -7.37332916720468e-03, -1.42647390514189e-02)


def _erf(x: tvm.tirx.PrimExpr) -> tvm.tirx.PrimExpr:
    """float32 erf as polynomials, which vectorize (see `_ERF_P`)."""
    x = T.max(T.min(x, T.float32(4)), T.float32(-4))
    x2 = x * x
    p, q = T.float32(_ERF_P[0]), T.float32(_ERF_Q[0])
    for coefficient in _ERF_P[1:]:
        p = p * x2 + T.float32(coefficient)
    for coefficient in _ERF_Q[1:]:
        q = q * x2 + T.float32(coefficient)
    return x * p / q


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
            value = T.float32(0.5) * value * (T.float32(1) + _erf(value * T.float32(1 / math.sqrt(2))))
    return value


def _dot(a, b, row, col, k0, ku: int) -> tvm.tirx.PrimExpr:
    """a[row, k0 : k0 + ku] . b[k0 : k0 + ku, col], written out (one accumulator update)."""
    return sum((a[row, k0 + u] * b[k0 + u, col] for u in range(1, ku)), a[row, k0] * b[k0, col])


def _prim_func(kernel, m: int, n: int, k: int, b_shape: tuple[int, ...],
               addends: list[tuple[int, int]]) -> tvm.tirx.PrimFunc:
    """The PrimFunc `(a[M, K], b[b_shape], addends..., c[M, N])` running the macro
    `kernel(a, b, c, addends)`."""
    # One signature per number of addends (TVMScript parameters are written out).
    if not addends:
        @T.prim_func
        def gemm(a: T.Buffer((m, k), "float32"), b: T.Buffer(b_shape, "float32"),
                 c: T.Buffer((m, n), "float32")):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            kernel(a, b, c, ())
    elif len(addends) == 1:
        @T.prim_func
        def gemm(a: T.Buffer((m, k), "float32"), b: T.Buffer(b_shape, "float32"),
                 e0: T.Buffer(addends[0], "float32"), c: T.Buffer((m, n), "float32")):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            kernel(a, b, c, (e0,))
    else:
        @T.prim_func
        def gemm(a: T.Buffer((m, k), "float32"), b: T.Buffer(b_shape, "float32"),
                 e0: T.Buffer(addends[0], "float32"), e1: T.Buffer(addends[1], "float32"),
                 c: T.Buffer((m, n), "float32")):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            kernel(a, b, c, (e0, e1))

    return gemm


def _columns(b, col0):
    """Columns [col0, col0 + nr) of a row-major [K, N] buffer as `(kk, j) -> element`."""
    return lambda kk, j: b[kk, col0 + j]


def packed_shape(n: int, k: int, nr: int) -> tuple[int, int, int]:
    """Shape of B[K, N] packed into panels of `nr` columns: [ceil(N / nr), K, nr], the last
    panel zero-padded; each panel is one contiguous run, read in order by the GEMM."""
    return (-(-n // nr), k, nr)


def cpu_gemm(mr: int, nr: int, packed: bool, m: int, n: int, k: int, epilogue: tuple[Step, ...],
             addends: list[tuple[int, int]]) -> tvm.tirx.PrimFunc:
    """The GEMM kernel with an mr x nr register tile for fixed M, N, K (tails included) and
    epilogue; B is [K, N], or `packed_shape` when `packed`; `addends`: each epilogue addend's
    (rows, columns), the PrimFunc's parameters after b.

    Each parallel task owns a panel of `nr` columns and walks down it `mr` rows at a time
    (the last M % mr rows as one shorter tile), accumulating the tile over all of K in
    registers and writing `epilogue(tile)` from there. The columns left over (N % nr) are one
    more panel, computed the same way but stored element by element."""
    full_m, full_n = m // mr * mr, n // nr * nr

    def b_panel(b, panel):
        """B's columns [panel * nr, panel * nr + nr) as `(kk, j) -> element`."""
        return (lambda kk, j: b[panel, kk, j]) if packed else _columns(b, panel * nr)

    @T.macro
    def tile(a, b_cols, c, extra, col0, row0, rows, cols):
        # "global" scope: a stack array LLVM keeps in registers ("local" allocates a workspace
        # LLVM cannot prove unaliased, so every update is stored back).
        acc = T.decl_buffer((rows, nr), "float32", scope="global")
        for i in T.unroll(rows):
            for j in T.vectorized(nr):
                acc[i, j] = T.float32(0)
        for kk in range(k):
            for i in T.unroll(rows):
                for j in T.vectorized(nr):
                    acc[i, j] = acc[i, j] + a[row0 + i, kk] * b_cols(kk, j)
        if cols == nr:
            for i in T.unroll(rows):
                for j in T.vectorized(nr):
                    c[row0 + i, col0 + j] = _epilogue(acc[i, j], row0 + i, col0 + j, epilogue, extra)
        else:
            for i, j in T.grid(rows, cols):
                c[row0 + i, col0 + j] = _epilogue(acc[i, j], row0 + i, col0 + j, epilogue, extra)

    @T.macro
    def panel_of(a, b_cols, c, extra, col0, cols):
        for block in range(m // mr):
            tile(a, b_cols, c, extra, col0, block * mr, mr, cols)
        if m > full_m:
            tile(a, b_cols, c, extra, col0, full_m, m - full_m, cols)

    @T.macro
    def kernel(a, b, c, extra):
        for panel in T.parallel(n // nr):
            panel_of(a, b_panel(b, panel), c, extra, panel * nr, nr)
        if n > full_n and packed:  # the last panel is zero-padded
            panel_of(a, b_panel(b, n // nr), c, extra, full_n, n - full_n)
        if n > full_n and not packed:  # the last columns, copied into a zero-padded panel
            last = T.decl_buffer((k, nr), "float32", scope="global")
            for kk, j in T.grid(k, nr):
                last[kk, j] = T.if_then_else(j < n - full_n, b[kk, T.min(full_n + j, n - 1)], T.float32(0))
            panel_of(a, _columns(last, 0), c, extra, full_n, n - full_n)

    return _prim_func(kernel, m, n, k, packed_shape(n, k, nr) if packed else (k, n), addends)


def cpu_gemv(ku: int, cores: int, m: int, n: int, k: int, epilogue: tuple[Step, ...],
             addends: list[tuple[int, int]]) -> tvm.tirx.PrimFunc:
    """The GEMV kernel (one output row at a time): each of `cores` parallel tasks owns an equal
    run of columns (`width`, a multiple of `VECTOR`) and adds `ku` rows of B at a time into its
    accumulator row (in L1), so each task streams long contiguous runs of B's rows."""
    width = max(VECTOR, n // cores // VECTOR * VECTOR)
    full_n, full_k = n // width * width, k // ku * ku

    @T.macro
    def body(a, b, c, extra):
        for panel in T.parallel(n // width):
            acc = T.decl_buffer((width,), "float32", scope="local")
            for r in range(m):
                for jo in range(width // VECTOR):
                    for ji in T.vectorized(VECTOR):
                        acc[jo * VECTOR + ji] = T.float32(0)
                for kk in range(k // ku):
                    for jo in range(width // VECTOR):
                        for ji in T.vectorized(VECTOR):
                            acc[jo * VECTOR + ji] = acc[jo * VECTOR + ji] + _dot(
                                a, b, r, panel * width + jo * VECTOR + ji, kk * ku, ku)
                for kk in range(k - full_k):
                    for jo in range(width // VECTOR):
                        for ji in T.vectorized(VECTOR):
                            acc[jo * VECTOR + ji] = (acc[jo * VECTOR + ji] + a[r, full_k + kk]
                                                     * b[full_k + kk, panel * width + jo * VECTOR + ji])
                for jo in range(width // VECTOR):
                    for ji in T.vectorized(VECTOR):
                        c[r, panel * width + jo * VECTOR + ji] = _epilogue(
                            acc[jo * VECTOR + ji], r, panel * width + jo * VECTOR + ji, epilogue, extra)

    @T.macro
    def kernel(a, b, c, extra):
        body(a, b, c, extra)
        for r, j in T.grid(m, n - full_n):
            c[r, full_n + j] = T.float32(0)
            for kk in range(k):
                c[r, full_n + j] = c[r, full_n + j] + a[r, kk] * b[kk, full_n + j]
            c[r, full_n + j] = _epilogue(c[r, full_n + j], r, full_n + j, epilogue, extra)

    return _prim_func(kernel, m, n, k, (k, n), addends)
