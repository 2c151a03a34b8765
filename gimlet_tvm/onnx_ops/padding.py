"""Pad with pads / constant_value / axes given at run time, and CenterCropPad.

The output length of each padded axis is computed as an int64 tensor and bound to a fresh
symbolic dim; each axis is then filled by gathering from the source index of every output
position (clamped for 'edge', mirrored for 'reflect', modulo the length for 'wrap'), and for
'constant' the positions outside the input are set to the value. Negative pads crop.
Pad with all of pads, value and axes constant goes to TVM's converter as before.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from ._common import (OnnxOpConverter, const, const_value, dtype_of, normalize_axes,
                      optional_input, rank_of, reject, scalar, shape_from_tensor, static_shape)

_op = relax.op
_MODES = ("constant", "edge", "reflect", "wrap")


def _i64(value: int) -> relax.Expr:
    return scalar(value, "int64")


def _source_index(s: relax.Expr, length: relax.Expr, mode: str) -> relax.Expr:
    """The input index output positions `s` (offset into the input, may be outside) read."""
    last = _op.subtract(length, _i64(1))
    if mode in ("constant", "edge"):
        return _op.minimum(_op.maximum(s, _i64(0)), last)
    if mode == "wrap":
        return _op.floor_mod(s, length)
    period = _op.maximum(_op.multiply(last, _i64(2)), _i64(1))
    t = _op.floor_mod(s, period)
    return _op.where(_op.less(t, length), t, _op.subtract(period, t))


def _full_rank(bb: relax.BlockBuilder, values: relax.Expr, axes: relax.Expr | None,
               rank: int) -> relax.Expr:
    """Per-axis `values` ([len(axes)], int64) spread to all `rank` dims, 0 elsewhere."""
    if axes is None:
        return values
    axes = bb.emit(_op.astype(axes, "int64"))
    axes = _op.where(_op.less(axes, _i64(0)), _op.add(axes, _i64(rank)), axes)
    hits = _op.astype(_op.equal(_op.expand_dims(axes, 1),
                                const(np.arange(rank, dtype="int64"))), "int64")
    return bb.emit(_op.sum(_op.multiply(hits, _op.expand_dims(values, 1)), axis=[0]))


def _pad(bb: relax.BlockBuilder, x: relax.Expr, begin: relax.Expr, end: relax.Expr, mode: str,
        value: relax.Expr, dims: list[int]) -> relax.Expr:
    """`x` padded by the run-time int64 [rank] tensors `begin`/`end` along `dims` (the others
    have zero pads); `value` (0-d, x's dtype) fills 'constant' padding."""
    rank = rank_of(x)
    shape = static_shape(x)
    if shape is not None and any(shape[d] == 0 for d in dims):
        raise reject("Pad", "an empty padded axis")
    lengths = bb.emit(_op.shape_to_tensor(_op.shape_of(x)))
    out = bb.emit(_op.add(lengths, _op.add(begin, end)))
    out_dims = shape_from_tensor(bb, out, rank, "pad").values
    for d in dims:
        at = const(np.int64(d))
        length = bb.emit(_op.take(lengths, at))
        s = bb.emit(_op.subtract(_op.arange(0, out_dims[d], 1, "int64"), _op.take(begin, at)))
        x = bb.emit(_op.take(x, _source_index(s, length, mode), d))
        if mode == "constant":
            inside = _op.logical_and(_op.greater_equal(s, _i64(0)), _op.less(s, length))
            if rank - d > 1:
                inside = _op.expand_dims(inside, list(range(1, rank - d)))
            x = bb.emit(_op.where(inside, x, value))
    return x


class Pad(OnnxOpConverter):
    """Pad-11/13/18/19 with run-time pads, constant_value or axes (modes constant, edge,
    reflect, wrap); Pad-2 and all-constant inputs: TVM's converter."""

    @classmethod
    def get_converter(cls, opset: int) -> Callable:
        tvm_convert = onnx_frontend.Pad.get_converter(opset)

        def convert(bb, inputs, attr, params):
            runtime = [x for x in inputs[1:] if x is not None and const_value(x) is None]
            if opset < 11 or not runtime:
                return tvm_convert(bb, inputs, attr, params)
            return cls._runtime(bb, inputs, attr)

        return convert

    @classmethod
    def _runtime(cls, bb, inputs, attr):
        x = inputs[0]
        rank = rank_of(x)
        mode = attr.get("mode", b"constant").decode()
        if mode not in _MODES:
            raise reject(cls.__name__, f"mode={mode!r}")
        axes = optional_input(inputs, 3)
        count = rank if axes is None else (static_shape(axes) or [None])[0]
        if rank < 0 or count is None:
            raise reject(cls.__name__, "an unknown rank or number of axes")
        pads = bb.emit(_op.astype(inputs[1], "int64"))
        begin = _op.strided_slice(pads, [0], [0], [count])
        end = _op.strided_slice(pads, [0], [count], [2 * count])
        begin, end = (_full_rank(bb, bb.emit(p), axes, rank) for p in (begin, end))
        value = optional_input(inputs, 2)
        if value is None or static_shape(value) == [0]:
            value = scalar(0, dtype_of(x))
        else:
            value = bb.emit(_op.astype(_op.reshape(value, []), dtype_of(x)))
        dims = list(range(rank))
        fixed_axes = None if axes is None else const_value(axes)
        if fixed_axes is not None:
            dims = sorted(set(normalize_axes(fixed_axes.tolist(), rank)))
        return _pad(bb, x, begin, end, mode, value, dims)


class CenterCropPad(OnnxOpConverter):
    """CenterCropPad-18: each of `axes` (default all) cropped or zero-padded to the run-time or
    constant target length around its center (the extra element goes to the end)."""

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        x, target = inputs
        rank = rank_of(x)
        count = (static_shape(target) or [None])[0]
        if rank < 0 or count is None:
            raise reject(cls.__name__, "an unknown rank or number of axes")
        axes = normalize_axes(attr.get("axes", range(rank)), rank)
        lengths = _op.take(_op.shape_to_tensor(_op.shape_of(x)), const(np.array(axes, "int64")))
        diff = bb.emit(_op.subtract(_op.astype(target, "int64"), lengths))
        # floor half of |diff| toward zero: the crop offset or the padding before
        half = bb.emit(_op.multiply(_op.sign(diff), _op.floor_divide(_op.abs(diff), _i64(2))))
        axes_c = const(np.array(axes, "int64"))
        begin = _full_rank(bb, half, axes_c, rank)
        end = _full_rank(bb, bb.emit(_op.subtract(diff, half)), axes_c, rank)
        return _pad(bb, x, begin, end, "constant", scalar(0, dtype_of(x)), sorted(set(axes)))
