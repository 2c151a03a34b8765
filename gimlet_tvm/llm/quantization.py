"""Weights kept quantized in memory: GGUF's block formats, dequantized inside the kernels, so a
decode step reads a quarter (Q8_0) or about a sixth (Q4_1) of the bytes of float32 weights.

A block is 32 weights of one output row along the input axis: Q8_0 stores a float16 scale `d`
and 32 int8 `q` (w = d * q); Q4_1 a float16 scale `d`, a float16 minimum `m` and 16 bytes of
4-bit `q` (w = d * q + m), byte j holding element j in its low nibble and element j + 16 in its
high one. `quantization="q8"` keeps linear weights as Q8_0, `"q4"` as Q4_1. A weight is split
into arrays, each a parameter of its `QuantizedLinear`: `<layer>.weight_scales` (float16
[out, in / 32]), `<layer>.weight_mins` (Q4_1 only, likewise), `<layer>.weight_quants` (Q8_0:
int8 [out, in]; Q4_1: uint8 [out, in / 2], GGUF's bytes).

`quantize_module` swaps every `nn.Linear` of a model whose input size is a multiple of 32 for
a `QuantizedLinear`; embeddings, norms and biases stay float32. A model with tied embeddings
gets a Q8_0 copy of them as its output head (`lm_head`, made from the embeddings' tensor),
whatever the quantization: the float32 table stays for the lookup (one row per token), and
decode reads the copy's quarter of its bytes (in SmolLM2, the table is a fifth of the model;
llama.cpp keeps it at Q8_0 too).

On load (`load_quantized`), a GGUF tensor stored in the chosen format is taken as it is, bit
for bit (and a Q4_0 one under "q4": it is Q4_1 with m = -8 d, the same values); any other
tensor (float, or another GGUF type, dequantized first) is quantized with llama.cpp's
reference rounding (the `gguf` package's, which matches it).

The kernels: an input of one row per sequence ([rows, 1, in]: every layer's in decode, the
output head's in prefill too) goes through one TIR function per layer that reads each block,
dequantizes it in registers and multiplies it into the input rows, the output rows split
across the cores (`_gemv`): on CPUs the only pass over the weight. Prefill's tokens ([1, n,
in]), and every input on other targets, multiply as `nn.Linear` does (the CPU library's GEMM
on CPUs) with the weight dequantized into a float32 temporary first: there the matrix
product, not the weight's bytes, is the cost.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import gguf
import numpy as np
import tvm
from tvm import te
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.script import tirx as T

from ..errors import WeightsError
from ..targets import spec_for
from .config import LLMConfig
from .families.base import DecoderLM, WeightSource
from .weights import Checkpoint

QUANTIZATIONS = (None, "q8", "q4")
BLOCK = 32  # weights per block, along the input axis
HALF = BLOCK // 2


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A GGUF block format as the kernels keep it: its type, the dtype of its quants array and
    how many weights share a byte, whether it has minimums, and its block's size in bytes."""

    gguf_type: gguf.GGMLQuantizationType
    quants_dtype: str
    per_byte: int
    has_mins: bool

    @property
    def block_bytes(self) -> int:
        return gguf.GGML_QUANT_SIZES[self.gguf_type][1]

    @property
    def name(self) -> str:
        return self.gguf_type.name


Q8_0 = BlockFormat(gguf.GGMLQuantizationType.Q8_0, "int8", 1, False)
Q4_0 = BlockFormat(gguf.GGMLQuantizationType.Q4_0, "uint8", 2, False)
Q4_1 = BlockFormat(gguf.GGMLQuantizationType.Q4_1, "uint8", 2, True)
FORMAT_OF = {"q8": Q8_0, "q4": Q4_1}
TIED_HEAD_FORMAT = Q8_0  # the output head copied from tied embeddings
HEAD, EMBEDDINGS = "lm_head.weight", "embed_tokens.weight"  # `DecoderLM`'s parameters
# GGUF types read from a file as they are, by the format they are kept in.
TAKEN_AS_IS = {Q8_0: (Q8_0,), Q4_1: (Q4_1, Q4_0)}
READABLE = {f.name: f for f in (Q8_0, Q4_0, Q4_1)}

SCALES, MINS, QUANTS = "weight_scales", "weight_mins", "weight_quants"
SUFFIXES = (SCALES, MINS, QUANTS)


# --- the model side -----------------------------------------------------------------------

class QuantizedLinear(nn.Module):
    """`nn.Linear` (y = x W^T + b) with W kept in a block format: `weight_scales`,
    `weight_mins` (formats with minimums), `weight_quants`; `bias` stays in `dtype`."""

    def __init__(self, in_features: int, out_features: int, fmt: BlockFormat, bias: bool = True,
                 dtype: str = "float32"):
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"{in_features} input features do not split into blocks of {BLOCK}")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        blocks = (out_features, in_features // BLOCK)
        self.weight_scales = nn.Parameter(blocks, "float16")
        self.weight_mins = nn.Parameter(blocks, "float16") if fmt.has_mins else None
        self.weight_quants = nn.Parameter((out_features, in_features // fmt.per_byte), fmt.quants_dtype)
        self.bias = nn.Parameter((out_features,), dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        *lead, k = x.shape
        target = tvm.target.Target.current(allow_none=True)
        on_cpu = target is None or spec_for(target).is_cpu
        if not (on_cpu and len(lead) == 2 and isinstance(lead[1], int) and lead[1] == 1):
            out = op.matmul(x, op.permute_dims(self._dequantized()))
            return out + self.bias if self.bias is not None else out
        weights = [self.weight_scales, *([self.weight_mins] if self.fmt.has_mins else []),
                   self.weight_quants, *([self.bias] if self.bias is not None else [])]
        return op.tensor_ir_op(
            _gemv(self.fmt, self.out_features, k, self.bias is not None),
            f"gemv_{self.fmt.name.lower()}", [x, *weights],
            Tensor.placeholder((lead[0], 1, self.out_features), x.dtype))

    def _dequantized(self) -> Tensor:
        """The float32 weight [out, in]."""
        fmt = self.fmt
        tensors = [self.weight_scales, *([self.weight_mins] if fmt.has_mins else []), self.weight_quants]

        def compute(scales: te.Tensor, *rest: te.Tensor) -> te.Tensor:
            mins, quants = rest if fmt.has_mins else (None, rest[0])
            return te.compute(
                (self.out_features, self.in_features // BLOCK, 2, HALF),
                lambda j, b, h, i: _weight(fmt, scales, mins, quants, j, b, h, i),
                name="dequantize")

        blocks = op.tensor_expr_op(compute, f"dequantize_{fmt.name.lower()}", tensors)
        return op.reshape(blocks, (self.out_features, self.in_features))


def _quant(fmt: BlockFormat, quants, j, b, half, i) -> tvm.tirx.PrimExpr:
    """The quantized value of weight [j, b * 32 + half * 16 + i], as float32 (`half` and `i`
    may be loop variables)."""
    if fmt.per_byte == 2:
        nibbles = quants[j, b * HALF + i] >> tvm.tirx.Cast("uint8", half * 4)
        return tvm.tirx.Cast("float32", nibbles & tvm.tirx.const(15, "uint8"))
    return tvm.tirx.Cast("float32", quants[j, b * BLOCK + half * HALF + i])


def _weight(fmt: BlockFormat, scales, mins, quants, j, b, half, i) -> tvm.tirx.PrimExpr:
    """The float32 weight [j, b * 32 + half * 16 + i]: d * q (+ m)."""
    weight = tvm.tirx.Cast("float32", scales[j, b]) * _quant(fmt, quants, j, b, half, i)
    return weight + tvm.tirx.Cast("float32", mins[j, b]) if fmt.has_mins else weight


# Output rows per parallel task: a task sums each lone input row's blocks (for the minimums'
# term) once for this many rows.
ROWS_PER_TASK = 32
# Input rows that share each dequantized block (batched decode; the logits of a prefill of
# several sequences); the rows left over go one at a time.
TILE = 4


@functools.lru_cache(maxsize=None)
def _gemv(fmt: BlockFormat, n: int, k: int, bias: bool) -> tvm.tirx.PrimFunc:
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
        return _quant(fmt, quants, j, b, half, i)

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
                    w[half * HALF + i] = _weight(fmt, scales, mins, quants, j, b, half, i)
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
    return _SIGNATURES[fmt.has_mins, bias](body, n, k, fmt).without_attr("global_symbol")


def _signature_q(body, n: int, k: int, fmt: BlockFormat) -> tvm.tirx.PrimFunc:
    @T.prim_func
    def gemv(var_x: T.handle, scales: T.Buffer((n, k // BLOCK), "float16"),
             quants: T.Buffer((n, k // fmt.per_byte), fmt.quants_dtype), var_out: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        m = T.int64()
        x = T.match_buffer(var_x, (m, 1, k), "float32")
        out = T.match_buffer(var_out, (m, 1, n), "float32")
        body(x, scales, None, quants, lambda value, j: value, out, m)
    return gemv


def _signature_qb(body, n: int, k: int, fmt: BlockFormat) -> tvm.tirx.PrimFunc:
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


def _signature_mq(body, n: int, k: int, fmt: BlockFormat) -> tvm.tirx.PrimFunc:
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


def _signature_mqb(body, n: int, k: int, fmt: BlockFormat) -> tvm.tirx.PrimFunc:
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


def quantize_module(model: DecoderLM, quantization: str | None) -> None:
    """Swap the model's linear layers (input size a multiple of 32) for `QuantizedLinear`s in
    `quantization`'s format, and give a model with tied embeddings a Q8_0 output head (None:
    keep them float)."""
    if quantization is None:
        return
    fmt = FORMAT_OF[quantization]

    def swap(module: nn.Module) -> nn.Module:
        if isinstance(module, nn.Linear) and module.in_features % BLOCK == 0:
            return QuantizedLinear(module.in_features, module.out_features, fmt,
                                   bias=module.bias is not None, dtype=module.weight.dtype)
        if isinstance(module, nn.ModuleList):
            for index, item in enumerate(module):
                module[index] = swap(item)
        elif isinstance(module, nn.Module):
            for name, item in vars(module).items():
                if isinstance(item, nn.Module):
                    setattr(module, name, swap(item))
        return module

    swap(model)
    config = model.config
    if config.tie_word_embeddings and config.hidden_size % BLOCK == 0:
        model.lm_head = QuantizedLinear(config.hidden_size, config.vocab_size, TIED_HEAD_FORMAT,
                                        bias=False, dtype=model.dtype)


# --- the load side ------------------------------------------------------------------------

def quantized_sources(sources: dict[str, WeightSource], config: LLMConfig) -> dict[str, WeightSource]:
    """A family's `weight_sources` and, with tied embeddings, the quantized output head's:
    the embeddings' tensor."""
    if not config.tie_word_embeddings:
        return sources
    return {**sources, HEAD: sources[EMBEDDINGS]}


def quantized_weight(param: str) -> str | None:
    """The weight a quantized parameter is part of (`x.weight_quants` -> `x.weight`), or None."""
    layer, _, suffix = param.rpartition(".")
    return f"{layer}.weight" if suffix in SUFFIXES else None


def split_blocks(fmt: BlockFormat, data: np.ndarray) -> dict[str, np.ndarray]:
    """GGUF blocks (uint8 [rows, blocks * block bytes]) as the kernels' arrays, by suffix:
    scales (and mins) float16 [rows, blocks], quants [rows, blocks * 32 / per_byte]."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, fmt.block_bytes)
    header = 4 if fmt.has_mins else 2
    arrays = {SCALES: blocks[..., 0:2].copy().view(np.float16).reshape(rows, -1),
              QUANTS: blocks[..., header:].reshape(rows, -1).copy().view(fmt.quants_dtype)}
    if fmt.has_mins:
        arrays[MINS] = blocks[..., 2:4].copy().view(np.float16).reshape(rows, -1)
    return arrays


def load_quantized(weight: str, source: WeightSource, checkpoint: Checkpoint,
                   quantization: str) -> dict[str, np.ndarray]:
    """The arrays of the quantized `weight` (a parameter name ending in `.weight`) by parameter
    name, made from `source`'s tensors: each one stored in the format (or one it converts from
    exactly) is taken as it is, any other quantized from its float values; then joined along
    the output axis. The head copied from tied embeddings is Q8_0 under every quantization."""
    tied_head = weight == HEAD and checkpoint.config.tie_word_embeddings
    fmt = TIED_HEAD_FORMAT if tied_head else FORMAT_OF[quantization]
    parts = []
    for name in source.names:
        kind, data = checkpoint.raw(name)
        stored = READABLE.get(kind)
        if stored in TAKEN_AS_IS[fmt]:
            arrays = split_blocks(stored, data)
        else:
            floats = checkpoint.get(name)
            floats = np.ascontiguousarray(floats.T if source.transposed else floats)
            try:
                arrays = split_blocks(fmt, gguf.quants.quantize(floats, fmt.gguf_type))
            except ValueError as err:
                raise WeightsError(f"{checkpoint.path.name}: cannot quantize '{name}' to "
                                   f"{fmt.name}: {err}") from err
        if fmt.has_mins and MINS not in arrays:  # Q4_0 as Q4_1: w = d * q - 8 d
            arrays[MINS] = (arrays[SCALES].astype(np.float32) * -8).astype(np.float16)
        parts.append(arrays)
    layer = weight.rpartition(".")[0]
    return {f"{layer}.{suffix}": np.concatenate([p[suffix] for p in parts]) if len(parts) > 1
            else parts[0][suffix] for suffix in parts[0]}
