"""Integer and quantized linear ops: ConvInteger, QLinearConv, QLinearMatMul.

As ONNX's reference computes them: operands widened to int32 with their zero points
subtracted, an int32 convolution / matmul, and (QLinear*) a requantization in float64 with
round-half-to-even and saturation to the output's integer range.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from ._common import OnnxOpConverter, dtype_of, optional_input, rank_of, reject, static_shape

_op = relax.op


def _widened(x: relax.Expr, zero_point: relax.Expr | None) -> relax.Expr:
    """`x` as int32 less its zero point (scalar, or already shaped to broadcast)."""
    x = _op.astype(x, "int32")
    return x if zero_point is None else _op.subtract(x, _op.astype(zero_point, "int32"))


def _per_channel(value: relax.Expr | None, rank: int) -> relax.Expr | None:
    """A scalar, or a 1-D per-output-channel tensor reshaped to broadcast over axis 1 of a
    rank-`rank` NC... tensor (a 1-D tensor of one element is a scalar)."""
    if value is None or rank_of(value) == 0:
        return value
    return _op.reshape(value, [1, -1] + [1] * (rank - 2))


def _requantized(bb: relax.BlockBuilder, acc: relax.Expr, scale: relax.Expr,
                 zero_point: relax.Expr | None, dtype: str) -> relax.Expr:
    """round(acc * scale + zero_point) saturated to `dtype`, computed in float64."""
    value = _op.multiply(_op.astype(acc, "float64"), _op.astype(scale, "float64"))
    if zero_point is not None:
        value = _op.add(value, _op.astype(zero_point, "float64"))
    info = np.iinfo(dtype)
    value = _op.clip(_op.round(bb.emit(value)), float(info.min), float(info.max))
    return _op.astype(value, dtype)


def _per_channel_weight(value: relax.Expr | None, rank: int) -> relax.Expr | None:
    """A scalar, or a 1-D per-output-channel tensor shaped to broadcast over axis 0 of W."""
    if value is None or rank_of(value) == 0:
        return value
    return _op.reshape(value, [-1] + [1] * (rank - 1))


def _conv(bb: relax.BlockBuilder, x: relax.Expr, w: relax.Expr, bias: relax.Expr | None,
          attr: dict, opset: int) -> relax.Expr:
    """TVM's Conv converter (padding, groups, auto_pad) on int32 operands."""
    return bb.normalize(onnx_frontend.Conv.get_converter(max(opset, 11))(
        bb, [x, w, bias], dict(attr), None))


class ConvInteger(OnnxOpConverter):
    """ConvInteger-10: int32 convolution of zero-point-shifted operands; w_zero_point may be
    per output channel."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x, w = inputs[0], inputs[1]
        x = _widened(x, optional_input(inputs, 2))
        w = _widened(w, _per_channel_weight(optional_input(inputs, 3), rank_of(w)))
        return _conv(bb, bb.emit(x), bb.emit(w), None, attr, 11)


class QLinearConv(OnnxOpConverter):
    """QLinearConv-10: ConvInteger plus an int32 bias, requantized with
    x_scale * w_scale / y_scale (w_scale / w_zero_point per output channel or scalar)."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp = inputs[:8]
        rank = rank_of(x)
        acc = _conv(bb, bb.emit(_widened(x, x_zp)),
                    bb.emit(_widened(w, _per_channel_weight(w_zp, rank_of(w)))),
                    optional_input(inputs, 8), attr, 11)
        scale = _op.divide(_op.multiply(x_scale, _per_channel(w_scale, rank)), y_scale)
        return _requantized(bb, acc, bb.emit(scale), y_zp, dtype_of(y_zp if y_zp is not None
                                                                    else x))


class QLinearMatMul(OnnxOpConverter):
    """QLinearMatMul-10/21: int32 matmul of zero-point-shifted operands requantized with
    a_scale * b_scale / y_scale (computed in the scales' dtype, as the reference does).
    b's scale and zero point may be per column; per-row a scale / zero point is refused."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp = inputs
        if any(v is not None and np.prod(static_shape(v) or [0]) != 1 for v in (a_scale, a_zp)):
            raise reject(cls.__name__, "per-row a_scale / a_zero_point")
        acc = _op.matmul(_widened(a, a_zp), _widened(b, b_zp), out_dtype="int32")
        scale = _op.divide(_op.multiply(a_scale, b_scale), y_scale)
        return _requantized(bb, bb.emit(acc), bb.emit(scale), y_zp,
                            dtype_of(y_zp if y_zp is not None else a))
