"""The LLM's decode kernel over weights kept in a GGUF block format: `dequant_gemv`, out = x W^T
(+ bias), W dequantized block by block in registers (`gimlet_tvm.llm.quantization` keeps the
weights; this is the kernel its `QuantizedLinear` calls, and kernel selection's baseline for
the "dequant_gemv" op group).

A block is 32 weights of one output row along the input axis. `BlockLayout` is how a format's
arrays look to the kernel: Q8_0 a float16 scale `d` per block and int8 `q` [n, k] (w = d * q);
Q4_1 a float16 scale `d`, a float16 minimum `m` per block and uint8 [n, k / 2], byte
`b * 16 + i` of a row holding element `b * 32 + i` in its low nibble and `b * 32 + 16 + i` in
its high one (w = d * q + m). The PrimFunc is marked (`OP_GROUP`, `BLOCK_FORMAT`) so that kernel
selection finds its calls by what they are, not by their names.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import tvm
from tvm.script import tirx as T

BLOCK = 32  # weights per block, along the input axis
HALF = BLOCK // 2
OP_GROUP = "gimlet.op_group"
"""PrimFunc attribute: the op group a kernel computes ("dequant_gemv" here)."""
BLOCK_FORMAT = "gimlet.block_format"
"""PrimFunc attribute: the block format of a dequantizing kernel's weight ("q8_0", "q4_1")."""
DEQUANT_GEMV = "dequant_gemv"


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """A block format as the kernel reads it: its name, the dtype of its quants array, how
    many weights share a byte, and whether it has minimums."""

    name: str
    quants_dtype: str
    per_byte: int
    has_mins: bool


LAYOUTS = {layout.name: layout for layout in (BlockLayout("q8_0", "int8", 1, False),
                                              BlockLayout("q4_1", "uint8", 2, True))}


def quant(fmt: BlockLayout, quants, j, b, half, i) -> tvm.tirx.PrimExpr:
    """The quantized value of weight [j, b * 32 + half * 16 + i], as float32 (`half` and `i`
    may be loop variables)."""
    if fmt.per_byte == 2:
        nibbles = quants[j, b * HALF + i] >> tvm.tirx.Cast("uint8", half * 4)
        return tvm.tirx.Cast("float32", nibbles & tvm.tirx.const(15, "uint8"))
    return tvm.tirx.Cast("float32", quants[j, b * BLOCK + half * HALF + i])


def weight(fmt: BlockLayout, scales, mins, quants, j, b, half, i) -> tvm.tirx.PrimExpr:
    """The float32 weight [j, b * 32 + half * 16 + i]: d * q (+ m)."""
    weight = tvm.tirx.Cast("float32", scales[j, b]) * quant(fmt, quants, j, b, half, i)
    return weight + tvm.tirx.Cast("float32", mins[j, b]) if fmt.has_mins else weight


# Output rows per parallel task: a task sums each lone input row's blocks (for the minimums'
# term) once for this many rows.
ROWS_PER_TASK = 32
# Input rows that share each dequantized block (batched decode; the logits of a prefill of
# several sequences); the rows left over go one at a time.
TILE = 4


@functools.lru_cache(maxsize=None)
def dequant_gemv(fmt: BlockLayout, n: int, k: int, bias: bool) -> tvm.tirx.PrimFunc:
    """The decode kernel `(x[m, 1, k], scales, [mins,] quants, [bias,] out[m, 1, n])`:
    out = x W^T (+ bias), W dequantized block by block in registers.

    Tasks of `ROWS_PER_TASK` output rows run in parallel (each core streams its own part of
    the weight once). Input rows go in tiles of `TILE` (`tile`): each block is dequantized
    once (w = d q + m, 32 lanes) and multiplied into all of them. The rows left over, and so
    batch-1 decode, go one at a time (`row`), with less arithmetic per block: its 32 products
    are summed as 16 lanes (its two halves: a Q4_1 byte's low and high nibbles) before one
    multiply by its scale, sum_b d_b (sum_l q_bl x_bl) + sum_b m_b (sum_l x_bl), the
    blocks' sums of x made once per task; even and odd blocks go to two accumulators, so
    consecutive blocks do not wait on each other's adds."""
    blocks = k // BLOCK
    tasks = -(-n // ROWS_PER_TASK)
    vectors, tail = blocks // HALF, blocks % HALF  # per-block values of a row, as vectors of 16

    def d(scales, j, b):
        return tvm.tirx.Cast("float32", scales[j, b])

    def q(quants, j, b, half, i):
        return quant(fmt, quants, j, b, half, i)

    @T.macro
    def block_sums(x, r, sums):
        part = T.decl_buffer((HALF,), "float32", scope="global")
        for b in range(blocks):
            for i in T.vectorized(HALF):
                part[i] = x[r, 0, b * BLOCK + i] + x[r, 0, b * BLOCK + HALF + i]
            for i in T.vectorized(8):
                part[i] = part[i] + part[8 + i]
            for i in T.vectorized(4):
                part[i] = part[i] + part[4 + i]
            sums[b] = part[0] + part[1] + part[2] + part[3]

    @T.macro
    def add_block(acc, lane0, x, scale, quants, r, j, b):
        for i in T.vectorized(HALF):
            acc[lane0 + i] = acc[lane0 + i] + scale[b] * (
                q(quants, j, b, 0, i) * x[r, 0, b * BLOCK + i]
                + q(quants, j, b, 1, i) * x[r, 0, b * BLOCK + HALF + i])

    @T.macro
    def row(x, scales, mins, quants, sums, bias_of, out, r, j):
        # The row's scales as float32 first, 16 at a time: each block then broadcasts its
        # scale from memory, where converting it alone would take a vector op per block.
        scale = T.decl_buffer((blocks,), "float32", scope="global")
        for v in range(vectors):
            for i in T.vectorized(HALF):
                scale[v * HALF + i] = d(scales, j, v * HALF + i)
        for i in range(tail):
            scale[vectors * HALF + i] = d(scales, j, vectors * HALF + i)
        acc = T.decl_buffer((BLOCK,), "float32", scope="global")
        for i in T.vectorized(BLOCK):
            acc[i] = T.float32(0)
        for p in range(blocks // 2):
            add_block(acc, 0, x, scale, quants, r, j, 2 * p)
            add_block(acc, HALF, x, scale, quants, r, j, 2 * p + 1)
        if blocks % 2 == 1:
            add_block(acc, 0, x, scale, quants, r, j, blocks - 1)
        if fmt.has_mins:
            for v in range(vectors):
                for i in T.vectorized(HALF):
                    acc[HALF + i] = acc[HALF + i] + d(mins, j, v * HALF + i) * sums[v * HALF + i]
            for i in range(tail):
                acc[i] = acc[i] + d(mins, j, vectors * HALF + i) * sums[vectors * HALF + i]
        for i in T.vectorized(16):
            acc[i] = acc[i] + acc[16 + i]
        for i in T.vectorized(8):
            acc[i] = acc[i] + acc[8 + i]
        for i in T.vectorized(4):
            acc[i] = acc[i] + acc[4 + i]
        out[r, 0, j] = bias_of(acc[0] + acc[1] + acc[2] + acc[3], j)

    @T.macro
    def tile(x, scales, mins, quants, bias_of, out, r0, j):
        acc = T.decl_buffer((TILE, HALF), "float32", scope="global")
        for r in T.unroll(TILE):
            for i in T.vectorized(HALF):
                acc[r, i] = T.float32(0)
        for b in range(blocks):
            w = T.decl_buffer((BLOCK,), "float32", scope="global")
            for half in T.unroll(2):
                for i in T.vectorized(HALF):
                    w[half * HALF + i] = weight(fmt, scales, mins, quants, j, b, half, i)
            for r in T.unroll(TILE):
                for i in T.vectorized(HALF):
                    acc[r, i] = acc[r, i] + w[i] * x[r0 + r, 0, b * BLOCK + i] + w[HALF + i] * x[
                        r0 + r, 0, b * BLOCK + HALF + i]
        for r in T.unroll(TILE):
            for i in T.vectorized(8):
                acc[r, i] = acc[r, i] + acc[r, 8 + i]
            for i in T.vectorized(4):
                acc[r, i] = acc[r, i] + acc[r, 4 + i]
            out[r0 + r, 0, j] = bias_of(acc[r, 0] + acc[r, 1] + acc[r, 2] + acc[r, 3], j)

    @T.macro
    def body(x, scales, mins, quants, bias_of, out, m):
        for task in T.parallel(tasks):
            for t in range(m // TILE):
                for jj in range(ROWS_PER_TASK):
                    if task * ROWS_PER_TASK + jj < n:
                        tile(x, scales, mins, quants, bias_of, out, t * TILE, task * ROWS_PER_TASK + jj)
            for rr in range(m % TILE):
                sums = T.decl_buffer((blocks,), "float32", scope="global")
                if fmt.has_mins:
                    block_sums(x, m // TILE * TILE + rr, sums)
                for jj in range(ROWS_PER_TASK):
                    if task * ROWS_PER_TASK + jj < n:
                        row(x, scales, mins, quants, sums, bias_of, out, m // TILE * TILE + rr,
                            task * ROWS_PER_TASK + jj)

    # Made once per shape (parsing TVMScript takes a while; a model repeats its layers); no
    # global symbol, so every call site shares one function.
    func = _SIGNATURES[fmt.has_mins, bias](body, n, k, fmt).without_attr("global_symbol")
    return func.with_attrs({OP_GROUP: DEQUANT_GEMV, BLOCK_FORMAT: fmt.name})


def _signature_q(body, n: int, k: int, fmt: BlockLayout) -> tvm.tirx.PrimFunc:
    @T.prim_func
    def gemv(var_x: T.handle, scales: T.Buffer((n, k // BLOCK), "float16"),
             quants: T.Buffer((n, k // fmt.per_byte), fmt.quants_dtype), var_out: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        m = T.int64()
        x = T.match_buffer(var_x, (m, 1, k), "float32")
        out = T.match_buffer(var_out, (m, 1, n), "float32")
        body(x, scales, None, quants, lambda value, j: value, out, m)
    return gemv


def _signature_qb(body, n: int, k: int, fmt: BlockLayout) -> tvm.tirx.PrimFunc:
    @T.prim_func
    def gemv(var_x: T.handle, scales: T.Buffer((n, k // BLOCK), "float16"),
             quants: T.Buffer((n, k // fmt.per_byte), fmt.quants_dtype), bias: T.Buffer((n,), "float32"),
             var_out: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        m = T.int64()
        x = T.match_buffer(var_x, (m, 1, k), "float32")
        out = T.match_buffer(var_out, (m, 1, n), "float32")
        body(x, scales, None, quants, lambda value, j: value + bias[j], out, m)
    return gemv


def _signature_mq(body, n: int, k: int, fmt: BlockLayout) -> tvm.tirx.PrimFunc:
    @T.prim_func
    def gemv(var_x: T.handle, scales: T.Buffer((n, k // BLOCK), "float16"),
             mins: T.Buffer((n, k // BLOCK), "float16"),
             quants: T.Buffer((n, k // fmt.per_byte), fmt.quants_dtype), var_out: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        m = T.int64()
        x = T.match_buffer(var_x, (m, 1, k), "float32")
        out = T.match_buffer(var_out, (m, 1, n), "float32")
        body(x, scales, mins, quants, lambda value, j: value, out, m)
    return gemv


def _signature_mqb(body, n: int, k: int, fmt: BlockLayout) -> tvm.tirx.PrimFunc:
    @T.prim_func
    def gemv(var_x: T.handle, scales: T.Buffer((n, k // BLOCK), "float16"),
             mins: T.Buffer((n, k // BLOCK), "float16"),
             quants: T.Buffer((n, k // fmt.per_byte), fmt.quants_dtype), bias: T.Buffer((n,), "float32"),
             var_out: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        m = T.int64()
        x = T.match_buffer(var_x, (m, 1, k), "float32")
        out = T.match_buffer(var_out, (m, 1, n), "float32")
        body(x, scales, mins, quants, lambda value, j: value + bias[j], out, m)
    return gemv


# (has mins, has bias) -> the PrimFunc's parameters (TVMScript writes them out).
_SIGNATURES: dict[tuple[bool, bool], Callable[..., tvm.tirx.PrimFunc]] = {
    (False, False): _signature_q, (False, True): _signature_qb,
    (True, False): _signature_mq, (True, True): _signature_mqb,
}

