"""QuantizeLinear and DequantizeLinear to and from float8/float4 and 2-/4-bit integers, and
blocked quantization (`block_size`), for any quantized dtype.

Other cases stay with TVM's converters. Integers: y = clip(round_half_even(x / scale) + zero
point); float formats: y = cast(x / scale) with `saturate` (their zero point must be 0, as
ONNX requires, and is not read). Scale and zero point are scalars, per-axis vectors or, with
`block_size`, tensors whose `axis` dim is the number of blocks.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from ..carriers import FLOAT_BITS, carrier, is_carried
from ._common import OnnxOpConverter, optional_input, rank_of, reject, scalar, static_shape
from .carried import dtype_name, input_dtypes
from .casts import cast

_INTEGER_RANGES = {
    "uint8": (0, 255), "int8": (-128, 127), "uint16": (0, 65535), "int16": (-32768, 32767),
    "uint4": (0, 15), "int4": (-8, 7), "uint2": (0, 3), "int2": (-2, 1),
}


def _broadcast(bb: relax.BlockBuilder, op: str, value: relax.Expr, x: relax.Expr, axis: int,
               block_size: int) -> relax.Expr:
    """A scale or zero point shaped to broadcast against `x`."""
    rank = rank_of(x)
    if rank_of(value) == 0:
        return value
    axis = axis + rank if axis < 0 else axis
    if block_size:
        shape = static_shape(x)
        if shape is None:
            raise reject(op, "block_size on an input of unknown shape")
        repeated = relax.op.repeat(value, block_size, axis)
        return bb.emit(relax.op.strided_slice(repeated, [axis], [0], [shape[axis]]))
    if rank_of(value) != 1:
        raise reject(op, "a scale of rank > 1 without block_size")
    length = static_shape(value)
    if length is None:
        raise reject(op, "a scale of unknown length")
    dims = [1] * rank
    if length[0] != 1:
        dims[axis] = length[0]
    return bb.emit(relax.op.reshape(value, dims))


class _Ours(OnnxOpConverter):
    """TVM's converter of `cls.__name__`, unless `cls.dtype` (the quantized dtype) is carried
    or the node has `block_size`: then `cls.convert`."""

    @classmethod
    def dtype(cls, dtypes: list, attr: dict) -> str:
        raise NotImplementedError

    @classmethod
    def convert(cls, bb: relax.BlockBuilder, inputs: list, dtypes: list, dtype: str,
                attr: dict) -> relax.Expr:
        raise NotImplementedError

    @classmethod
    def get_converter(cls, opset: int):
        theirs = getattr(onnx_frontend, cls.__name__).get_converter(opset)

        def convert(bb, inputs, attr, params):
            dtypes = input_dtypes(cls.__name__, inputs, attr)
            dtype = cls.dtype(dtypes, attr)
            if not is_carried(dtype) and not attr.get("block_size", 0):
                return theirs(bb, inputs, attr, params)
            return cls.convert(bb, list(inputs), dtypes, dtype, attr)

        return convert


class QuantizeLinear(_Ours):
    """To float8/float4/int4/uint4/int2/uint2, and blocked quantization to any integer type
    (`precision` sets the dtype of x / scale)."""

    @classmethod
    def dtype(cls, dtypes, attr):
        if attr.get("output_dtype"):
            return dtype_name(attr["output_dtype"])
        return dtypes[2] if len(dtypes) > 2 and dtypes[2] is not None else "uint8"

    @classmethod
    def convert(cls, bb, inputs, dtypes, dtype, attr):
        x, scale, zero_point = inputs[0], inputs[1], optional_input(inputs, 2)
        axis, block_size = attr.get("axis", 1), attr.get("block_size", 0)
        compute = dtype_name(attr["precision"]) if attr.get("precision") else dtypes[0]
        if dtypes[1] != compute or dtypes[0] != compute:
            x = relax.op.astype(x, compute)
            scale = relax.op.astype(scale, compute)
        scale = _broadcast(bb, cls.__name__, scale, inputs[0], axis, block_size)
        scaled = bb.emit(relax.op.divide(x, scale))
        if dtype in FLOAT_BITS:
            return cast(bb, scaled, compute, dtype, bool(attr.get("saturate", 1)))
        if dtype not in _INTEGER_RANGES:
            raise reject(cls.__name__, f"output dtype {dtype}")
        low, high = _INTEGER_RANGES[dtype]
        value = relax.op.round(relax.op.where(relax.op.isnan(scaled), scalar(0, compute),
                                              scaled))
        value = relax.op.astype(value, "float32")
        if zero_point is not None:
            zero_point = _broadcast(bb, cls.__name__, zero_point, inputs[0], axis, block_size)
            value = relax.op.add(value, relax.op.astype(zero_point, "float32"))
        return bb.emit(relax.op.astype(relax.op.clip(value, low, high), carrier(dtype)))


class DequantizeLinear(_Ours):
    """From float8/float4/int4/uint4/int2/uint2, and blocked dequantization of any type:
    (x - zero point) * scale in float32, as `output_dtype` or the scale's dtype."""

    @classmethod
    def dtype(cls, dtypes, attr):
        return dtypes[0]

    @classmethod
    def convert(cls, bb, inputs, dtypes, dtype, attr):
        x, scale, zero_point = inputs[0], inputs[1], optional_input(inputs, 2)
        axis, block_size = attr.get("axis", 1), attr.get("block_size", 0)
        output = dtype_name(attr["output_dtype"]) if attr.get("output_dtype") else dtypes[1]
        if dtype in FLOAT_BITS:
            value = cast(bb, x, dtype, "float32")
        else:
            value = relax.op.astype(x, "float32")
            if zero_point is not None:
                zero_point = _broadcast(bb, cls.__name__, zero_point, x, axis, block_size)
                value = relax.op.subtract(value, relax.op.astype(zero_point, "float32"))
        scale = relax.op.astype(_broadcast(bb, cls.__name__, scale, x, axis, block_size),
                                "float32")
        return bb.emit(relax.op.astype(relax.op.multiply(value, scale), output))
