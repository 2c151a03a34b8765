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
across the cores (`targets.kernels.dequant_gemv`, which kernel selection may replace: the
"dequant_gemv" op group): on CPUs the only pass over the weight. Prefill's tokens ([1, n,
in]), and every input on other targets, multiply as `nn.Linear` does (the CPU library's GEMM
on CPUs) with the weight dequantized into a float32 temporary first: there the matrix
product, not the weight's bytes, is the cost.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import tvm
from tvm import te
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from ..errors import WeightsError
from ..targets import spec_for
from ..targets.kernels.dequant_gemv import BLOCK, HALF, LAYOUTS, BlockLayout, dequant_gemv, weight
from .config import LLMConfig
from .families.base import DecoderLM, WeightSource
from .weights import Checkpoint

QUANTIZATIONS = (None, "q8", "q4")


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

    @property
    def layout(self) -> BlockLayout:
        """The format as the decode kernel reads it (`dequant_gemv`; the kept formats only)."""
        return LAYOUTS[self.name.lower()]


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
            dequant_gemv(self.fmt.layout, self.out_features, k, self.bias is not None),
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
                lambda j, b, h, i: weight(fmt, scales, mins, quants, j, b, h, i),
                name="dequantize")

        blocks = op.tensor_expr_op(compute, f"dequantize_{fmt.name.lower()}", tensors)
        return op.reshape(blocks, (self.out_features, self.in_features))



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
