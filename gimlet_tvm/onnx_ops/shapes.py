"""Reshape, Unsqueeze, Slice, Split and Expand with the target shape / axes / bounds / sizes
given at run time.

The output shape (or the sizes of Slice's and Split's pieces) is computed as an int64
tensor and bound to fresh symbolic dims (`shape_from_tensor`); constant shapes, axes and
bounds go to TVM's converters as before. (TVM's own run-time Slice, `dynamic_strided_slice`,
loses its shape function in FuseOps.)
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend

from ._common import (OnnxOpConverter, const, const_value, inclusive_cumsum, optional_input,
                      rank_of, reject, require, scalar, shape_from_tensor, static_shape)

_op = relax.op


def _runtime_tensor(expr: Any) -> bool:
    """Whether `expr` is a tensor whose value is only known at run time."""
    return (expr is not None and const_value(expr) is None
            and isinstance(expr.ty, relax.TensorType))


def _static_length(op: str, what: str, expr: relax.Expr) -> int:
    shape = static_shape(expr)
    if shape is None or len(shape) != 1:
        raise reject(op, f"run-time {what} of unknown length")
    return shape[0]


def _shape_tensor(bb: relax.BlockBuilder, x: relax.Expr) -> relax.Expr:
    return bb.emit(_op.shape_to_tensor(_op.shape_of(x)))


class _RunTimeOrTVM(OnnxOpConverter):
    """TVM's converter of the same op unless an input after the data is a run-time tensor
    (older opsets take attributes instead and have no such inputs)."""

    @classmethod
    def convert_runtime(cls, bb: relax.BlockBuilder, inputs: list, attr: dict) -> relax.Expr:
        raise NotImplementedError

    @classmethod
    def get_converter(cls, opset: int) -> Callable:
        tvm_convert = getattr(onnx_frontend, cls.__name__).get_converter(opset)

        def convert(bb, inputs, attr, params):
            if any(_runtime_tensor(x) for x in inputs[1:]):
                return cls.convert_runtime(bb, inputs, attr)
            return tvm_convert(bb, inputs, attr, params)

        return convert


class Reshape(_RunTimeOrTVM):
    """Reshape-5+ with the shape input at run time: 0 copies the input dim (unless
    allowzero=1), -1 takes what is left."""

    @classmethod
    def convert_runtime(cls, bb, inputs, attr):
        x = inputs[0]
        rank = rank_of(x)
        length = _static_length(cls.__name__, "shape", inputs[1])
        shape = bb.emit(_op.astype(inputs[1], "int64"))
        if length == 0:
            return bb.emit(_op.reshape(x, []))
        in_shape = _shape_tensor(bb, x)
        if not attr.get("allowzero", 0) and rank > 0:
            same_place = _op.take(in_shape, const(np.minimum(np.arange(length), rank - 1)))
            shape = bb.emit(_op.where(_op.equal(shape, scalar(0, "int64")), same_place, shape))
        total = _op.prod(in_shape) if rank > 0 else scalar(1, "int64")
        inferred = _op.equal(shape, scalar(-1, "int64"))
        known = _op.prod(_op.where(inferred, scalar(1, "int64"), shape))
        rest = _op.floor_divide(total, _op.maximum(known, scalar(1, "int64")))
        shape = bb.emit(_op.where(inferred, rest, shape))
        fits = _op.logical_and(_op.less_equal(_op.sum(_op.astype(inferred, "int64")), scalar(1, "int64")),
                               _op.equal(_op.prod(shape), total))
        shape = require(bb, shape, _op.logical_and(_op.greater_equal(shape, scalar(0, "int64")), fits),
                        cls.__name__, "the shape does not fit the input (a size below -1, two -1s, or "
                                      "another element count)")
        return bb.emit(_op.reshape(x, shape_from_tensor(bb, shape, length, "reshape")))


class Unsqueeze(_RunTimeOrTVM):
    """Unsqueeze-13+ with the axes input at run time."""

    @classmethod
    def convert_runtime(cls, bb, inputs, attr):
        x = inputs[0]
        out_rank = rank_of(x) + _static_length(cls.__name__, "axes", inputs[1])
        axes = bb.emit(_op.astype(inputs[1], "int64"))
        axes = bb.emit(_op.where(_op.less(axes, scalar(0, "int64")),
                                 _op.add(axes, scalar(out_rank, "int64")), axes))
        positions = const(np.arange(out_rank, dtype="int64"))
        hits = _op.astype(_op.equal(_op.expand_dims(axes, 1), positions), "int64")
        new = bb.emit(_op.minimum(_op.sum(hits, axis=[0]), scalar(1, "int64")))
        # Output dim j that is not new is input dim (number of old dims before j).
        old = bb.emit(_op.subtract(scalar(1, "int64"), new))
        source = bb.emit(_op.maximum(_op.subtract(inclusive_cumsum(bb, old, out_rank),
                                                  scalar(1, "int64")), scalar(0, "int64")))
        in_shape = _shape_tensor(bb, x) if rank_of(x) > 0 else const(np.ones(1, "int64"))
        sizes = _op.take(in_shape, _op.minimum(source, scalar(max(rank_of(x) - 1, 0), "int64")))
        shape = bb.emit(_op.where(_op.astype(new, "bool"), scalar(1, "int64"), sizes))
        return bb.emit(_op.reshape(x, shape_from_tensor(bb, shape, out_rank, "unsqueeze")))


class Slice(_RunTimeOrTVM):
    """Slice-10+ with starts/ends/axes/steps at run time (ONNX clamping, negative steps)."""

    @classmethod
    def convert_runtime(cls, bb, inputs, attr):
        x = inputs[0]
        rank = rank_of(x)
        length = _static_length(cls.__name__, "starts", inputs[1])
        i64 = lambda v: scalar(v, "int64")  # noqa: E731
        as_i64 = lambda e: bb.emit(_op.astype(e, "int64"))  # noqa: E731
        axes = optional_input(inputs, 3)
        axes = as_i64(axes) if axes is not None else const(np.arange(length, dtype="int64"))
        axes = bb.emit(_op.where(_op.less(axes, i64(0)), _op.add(axes, i64(rank)), axes))
        axes = require(bb, axes, _op.logical_and(_op.greater_equal(axes, i64(0)), _op.less(axes, i64(rank))),
                       cls.__name__, f"an axis is outside the {rank} dims of the input")
        steps = optional_input(inputs, 4)
        steps = as_i64(steps) if steps is not None else const(np.ones(length, "int64"))
        steps = require(bb, steps, _op.not_equal(steps, i64(0)), cls.__name__, "a step is 0")
        # hits[k, d]: slice entry k applies to dimension d
        hits = bb.emit(_op.astype(_op.equal(_op.expand_dims(axes, 1),
                                            const(np.arange(rank, dtype="int64"))), "int64"))
        sliced = bb.emit(_op.sum(hits, axis=[0]))

        def per_dim(values: relax.Expr, default: relax.Expr) -> relax.Expr:
            picked = _op.sum(_op.multiply(hits, _op.expand_dims(values, 1)), axis=[0])
            return bb.emit(_op.add(picked, _op.multiply(_op.subtract(i64(1), sliced), default)))

        dims = _shape_tensor(bb, x)
        step = per_dim(steps, i64(1))
        start = per_dim(as_i64(inputs[1]), i64(0))
        end = per_dim(as_i64(inputs[2]), dims)
        forward = bb.emit(_op.greater(step, i64(0)))
        low = bb.emit(_op.where(forward, i64(0), i64(-1)))
        high = bb.emit(_op.where(forward, dims, _op.subtract(dims, i64(1))))

        def clamp(v: relax.Expr) -> relax.Expr:
            v = _op.where(_op.less(v, i64(0)), _op.add(v, dims), v)
            return bb.emit(_op.minimum(_op.maximum(v, low), high))

        start = bb.emit(_op.minimum(_op.maximum(clamp(start), i64(0)), high))
        end = clamp(end)
        distance = _op.where(forward, _op.subtract(end, start), _op.subtract(start, end))
        magnitude = _op.abs(step)
        count = bb.emit(_op.maximum(_op.floor_divide(
            _op.add(distance, _op.subtract(magnitude, i64(1))), magnitude), i64(0)))
        sizes = shape_from_tensor(bb, count, rank, "slice").values
        for d in range(rank):
            at = const(np.int64(d))
            x = _take_range(bb, x, d, _op.take(start, at), sizes[d], _op.take(step, at))
        return x


def _take_range(bb: relax.BlockBuilder, x: relax.Expr, axis: int, start: relax.Expr,
                size: tirx.PrimExpr, step: relax.Expr | None = None) -> relax.Expr:
    """`size` elements of `x` along `axis` from the 0-d int64 tensor `start`, `step` apart."""
    index = _op.arange(0, size, 1, "int64")
    if step is not None:
        index = _op.multiply(index, step)
    return bb.emit(_op.take(x, _op.add(index, start), axis=axis))


class Split(_RunTimeOrTVM):
    """Split-13+ with the split sizes at run time (one output per entry)."""

    @classmethod
    def convert_runtime(cls, bb, inputs, attr):
        x = inputs[0]
        axis = attr.get("axis", 0)
        axis = axis + rank_of(x) if axis < 0 else axis
        parts = _static_length(cls.__name__, "split", inputs[1])
        split = bb.emit(_op.astype(inputs[1], "int64"))
        starts = bb.emit(_op.subtract(inclusive_cumsum(bb, split, parts), split))
        sizes = shape_from_tensor(bb, split, parts, "split").values
        return relax.Tuple([_take_range(bb, x, axis, _op.take(starts, const(np.int64(i))),
                                        sizes[i]) for i in range(parts)])


class Expand(_RunTimeOrTVM):
    """Expand-8/13 with the shape input at run time: ONNX's two-way broadcast of the input
    shape and the given one (a 1 on either side takes the other's dim)."""

    @classmethod
    def convert_runtime(cls, bb, inputs, attr):
        x = inputs[0]
        rank = rank_of(x)
        length = _static_length(cls.__name__, "shape", inputs[1])
        out_rank = max(rank, length)
        ones = lambda n: const(np.ones(n, "int64"))  # noqa: E731
        in_shape = _shape_tensor(bb, x) if rank > 0 else ones(0)
        in_shape = bb.emit(_op.concat([ones(out_rank - rank), in_shape]))
        shape = bb.emit(_op.concat([ones(out_rank - length), _op.astype(inputs[1], "int64")]))
        one = scalar(1, "int64")
        broadcasts = _op.logical_or(_op.equal(shape, in_shape),
                                    _op.logical_or(_op.equal(shape, one), _op.equal(in_shape, one)))
        shape = require(bb, shape, _op.logical_and(_op.greater_equal(shape, scalar(0, "int64")), broadcasts),
                        cls.__name__, "the shape does not broadcast with the shape of the input")
        shape = bb.emit(_op.where(_op.equal(shape, one), in_shape, shape))
        return bb.emit(_op.broadcast_to(x, shape_from_tensor(bb, shape, out_rank, "expand")))
