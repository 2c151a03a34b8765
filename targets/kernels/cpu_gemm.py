"""CPU GEMM and GEMV kernels with a fused epilogue: C[M, N] = epilogue(A[M, K] @ B[K, N]),
float32, row-major.

`cpu_gemm`: each parallel task owns a panel of `nr` columns (two vector registers), walks
down K in blocks and, per block, down the rows in register tiles of at most `mr` rows,
accumulating each tile in registers (in C between blocks), prefetching B ahead of use; the
last block writes the tile through the epilogue (bias / residual adds, ReLU, GELU, in the
group's order). The rows are split into tiles of equal height (or one less), so no thin tail
tile runs at a fraction of the speed; the last N % nr columns are one more, zero-padded panel.
With `packed`, B comes as `packed_shape` panels (built from a constant weight at build time):
each panel is one contiguous run read in order, where row-major B makes every step of K touch
another page. The tallest tile fills the vector registers: 6 x 2 vectors with AVX2's 16
(12 accumulators, 2 of B, 1 broadcast of A), 14 x 2 with AVX-512's 32.

`cpu_gemv` is the kernel for skinny M (batch 1, a few rows; memory-bound): one output row at
a time, the columns split in one run per core, each task streaming long contiguous runs of
B's rows, 4 rows of B per update of its accumulator row (which stays in L1), so B is read
once per output row, with no packing."""

from __future__ import annotations

import math

import tvm
from tvm.script import tirx as T

from . import Step

VECTOR = 32  # lanes of the GEMV's vector loops (4 AVX2 registers)
# The GEMM's block of K: B's block in a panel (256 x 2 vectors: 32 KiB with AVX-512) stays in
# L1 while every row tile of the panel goes through it.
KC = 256
# How far ahead (steps of K) the GEMM prefetches B, and into which cache (LLVM's locality 2:
# L2): one sequential stream per core reads B well below the bandwidth of many-row schedules
# unless it is prefetched (benchmarks/README.md has the measurement).
PREFETCH_AHEAD = 64
PREFETCH_LOCALITY = 2
CACHE_LINE = 64
# TVM makes a constant "global" allocation smaller than this (bytes) a stack array
# (LowerTVMBuiltin's kMaxStackAlloca); a larger one is a heap workspace.
STACK_BYTES = 1024


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


def row_tiles(m: int, rows: int) -> tuple[int, int, int]:
    """M rows as tiles of at most `rows`, all as tall as they can be: (tiles, height, short),
    the last `short` tiles one row shorter (M = 32, rows = 14: 11, 11, 10; not 14, 14, 4)."""
    tiles = -(-m // rows)
    height = -(-m // tiles)
    return tiles, height, tiles * height - m


def cpu_gemm(mr: int, nr: int, packed: bool, m: int, n: int, k: int, epilogue: tuple[Step, ...],
             addends: list[tuple[int, int]]) -> tvm.tirx.PrimFunc:
    """The GEMM kernel with register tiles of at most mr x nr for fixed M, N, K (tails
    included) and epilogue; B is [K, N], or `packed_shape` when `packed`; `addends`: each
    epilogue addend's (rows, columns), the PrimFunc's parameters after b.

    Each parallel task owns a panel of `nr` columns. It walks down K in blocks of `KC` and,
    for each, down the rows in tiles (`row_tiles`), adding the block's products into the
    tile's accumulators (in registers; stored in C between blocks) while prefetching B
    `PREFETCH_AHEAD` steps ahead; the last block writes `epilogue(tile)`. The columns left
    over (N % nr) are one more panel, computed the same way but stored element by element."""
    full_n = n // nr * nr
    tiles, height, short = row_tiles(m, mr)
    kc = min(KC, k)
    blocks = -(-k // kc)
    lines = max(1, nr * 4 // CACHE_LINE)  # of B, per step of K

    def b_panel(b, panel):
        """B's columns [panel * nr, panel * nr + nr) as `(kk, j) -> element`."""
        return (lambda kk, j: b[panel, kk, j]) if packed else _columns(b, panel * nr)

    @T.macro
    def load(acc, c, row0, rows, col0, cols, first):
        for i in T.unroll(rows):
            for j in T.vectorized(nr):
                if first or cols < nr:
                    acc[i, j] = T.float32(0)
                else:
                    acc[i, j] = c[row0 + i, col0 + j]
        if not first and cols < nr:
            for i, j in T.grid(rows, cols):
                acc[i, j] = c[row0 + i, col0 + j]

    def finished(acc, i, j, row0, col0, extra, last: bool) -> tvm.tirx.PrimExpr:
        """Accumulator [i, j] as C takes it: through the epilogue after the last block of K,
        as it is before."""
        return _epilogue(acc[i, j], row0 + i, col0 + j, epilogue, extra) if last else acc[i, j]

    @T.macro
    def store(acc, c, extra, row0, rows, col0, cols, last):
        if cols == nr:
            for i in T.unroll(rows):
                for j in T.vectorized(nr):
                    c[row0 + i, col0 + j] = finished(acc, i, j, row0, col0, extra, last)
        else:
            for i, j in T.grid(rows, cols):
                c[row0 + i, col0 + j] = finished(acc, i, j, row0, col0, extra, last)

    def tile_of(rows: int):
        """The macro for tiles of `rows` rows. Its accumulators are one stack array, or two
        when one would reach `STACK_BYTES` (TVM would put it on the heap, and LLVM, unsure it
        is not B or C, would store every update)."""
        top = rows if rows * nr * 4 < STACK_BYTES else -(-rows // 2)
        rest = rows - top
        rest_shape = (max(rest, 1), nr)

        @T.macro
        def tile(a, b_cols, c, extra, col0, row0, cols, k0, depth, first, last):
            # "global" scope: a stack array LLVM keeps in registers ("local" allocates a workspace).
            acc = T.decl_buffer((top, nr), "float32", scope="global")
            acc2 = T.decl_buffer(rest_shape, "float32", scope="global")
            load(acc, c, row0, top, col0, cols, first)
            load(acc2, c, row0 + top, rest, col0, cols, first)
            for kk in range(depth):
                for line in T.unroll(lines):
                    T.evaluate(T.call_intrin("void", "tirx.prefetch", T.address_of(
                        b_cols(k0 + kk + PREFETCH_AHEAD, line * CACHE_LINE // 4)), 0, PREFETCH_LOCALITY, 1))
                for i in T.unroll(top):
                    for j in T.vectorized(nr):
                        acc[i, j] = acc[i, j] + a[row0 + i, k0 + kk] * b_cols(k0 + kk, j)
                for i in T.unroll(rest):
                    for j in T.vectorized(nr):
                        acc2[i, j] = acc2[i, j] + a[row0 + top + i, k0 + kk] * b_cols(k0 + kk, j)
            store(acc, c, extra, row0, top, col0, cols, last)
            store(acc2, c, extra, row0 + top, rest, col0, cols, last)

        return tile

    tall, shorter = tile_of(height), tile_of(max(height - 1, 1))

    @T.macro
    def k_block(a, b_cols, c, extra, col0, cols, k0, depth, first, last):
        for t in range(tiles - short):
            tall(a, b_cols, c, extra, col0, t * height, cols, k0, depth, first, last)
        for t in range(short):
            shorter(a, b_cols, c, extra, col0, (tiles - short) * height + t * (height - 1), cols, k0, depth,
                    first, last)

    @T.macro
    def panel_of(a, b_cols, c, extra, col0, cols):
        if blocks == 1:
            k_block(a, b_cols, c, extra, col0, cols, 0, k, True, True)
        else:
            k_block(a, b_cols, c, extra, col0, cols, 0, kc, True, False)
            for block in range(1, blocks - 1):
                k_block(a, b_cols, c, extra, col0, cols, block * kc, kc, False, False)
            k_block(a, b_cols, c, extra, col0, cols, (blocks - 1) * kc, k - (blocks - 1) * kc, False, True)

    @T.macro
    def kernel(a, b, c, extra):
        for panel in T.parallel(n // nr):
            panel_of(a, b_panel(b, panel), c, extra, panel * nr, nr)
        if n > full_n and packed:  # the last panel is zero-padded
            panel_of(a, b_panel(b, n // nr), c, extra, full_n, n - full_n)
        if n > full_n and not packed:  # the last columns, copied into a zero-padded panel
            b_tail = T.decl_buffer((k, nr), "float32", scope="global")
            for kk, j in T.grid(k, nr):
                b_tail[kk, j] = T.if_then_else(j < n - full_n, b[kk, T.min(full_n + j, n - 1)], T.float32(0))
            panel_of(a, _columns(b_tail, 0), c, extra, full_n, n - full_n)

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
