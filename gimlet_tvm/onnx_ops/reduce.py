"""Reduce* ops: axes as attribute, constant input or run-time input; -inf/+inf-correct Max/Min.

TVM's max/min reductions start from the lowest/highest finite value, so a row of all -inf
(or an empty row) reduced by max gave -3.4e38 instead of -inf; `_extreme` corrects that.

Axes given at run time make the output shape data-dependent: each dimension is reduced or
kept by a run-time choice (`_reduce_if`), and with keepdims=0 the reduced dimensions are
dropped by a reshape to a computed shape, which needs the number of axes at import time.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tvm
from tvm import relax

from ._common import (OnnxOpConverter, const, const_value, dtype_of, inclusive_cumsum,
                      normalize_axes, optional_input, rank_of, reject, scalar, shape_from_tensor,
                      static_shape, with_fresh_shape)

_op = relax.op
Reducer = Callable[[relax.BlockBuilder, relax.Expr, list, bool], relax.Expr]


def _fill(value: float, dtype: str) -> relax.Expr:
    """`value` as a 0-d constant of `dtype`; infinities clip to an integer dtype's range."""
    if dtype == "bool":
        return scalar(value > 0, dtype)
    if not dtype.startswith(("float", "bfloat")):
        info = np.iinfo(dtype)
        value = 0 if np.isnan(value) else int(np.clip(value, info.min, info.max))
    return scalar(value, dtype)


def _reduced_sizes(x: relax.Expr, axes: list) -> list[int] | None:
    """The sizes of `x`'s reduced axes when all are static (other axes may be symbolic)."""
    values = getattr(getattr(x.ty, "shape", None), "values", None)
    if values is None or not all(isinstance(values[a], tvm.tirx.IntImm) for a in axes):
        return None
    return [int(values[a]) for a in axes]


def _empty_safe(reducer: Reducer, empty_value: float) -> Reducer:
    """`reducer` giving `empty_value` where it reduces no elements (TVM's reduction kernels
    leave those outputs unwritten)."""

    def safe(bb: relax.BlockBuilder, x: relax.Expr, axes: list, keepdims: bool) -> relax.Expr:
        out = reducer(bb, x, axes, keepdims)
        fill = _fill(empty_value, dtype_of(out))
        sizes = _reduced_sizes(x, axes)
        if sizes is not None:  # known at import time: no run-time test
            return out if all(sizes) else bb.emit(_op.full_like(out, fill))
        sizes = _op.take(_op.shape_to_tensor(_op.shape_of(x)), const(np.array(axes, "int64")))
        empty = _op.equal(_op.prod(sizes), scalar(0, "int64"))
        return bb.emit(_op.where(empty, fill, out))

    return safe


def _extreme(reduce: Callable, empty_value: float) -> Reducer:
    """A max/min reducer whose result is `empty_value` (-inf/+inf) when nothing else is seen."""

    def reducer(bb: relax.BlockBuilder, x: relax.Expr, axes: list, keepdims: bool) -> relax.Expr:
        dtype = dtype_of(x)
        if dtype == "bool":  # TVM has no bool max/min
            return bb.emit(_op.astype(reduce(_op.astype(x, "uint8"), axes, keepdims), "bool"))
        result = bb.emit(reduce(x, axes, keepdims))
        if not dtype.startswith(("float", "bfloat")):
            return result
        other = bb.emit(_op.astype(_op.not_equal(x, scalar(empty_value, dtype)), "float32"))
        seen = bb.emit(_op.max(other, axes, keepdims))
        return bb.emit(_op.where(_op.greater(seen, scalar(0, "float32")), result,
                                 scalar(empty_value, dtype)))

    return _empty_safe(reducer, empty_value)


def _plain(reduce: Callable, empty_value: float) -> Reducer:
    return _empty_safe(lambda bb, x, axes, keepdims: bb.emit(reduce(x, axes, keepdims)),
                       empty_value)


_SUM = _plain(_op.sum, 0)
# op: (map before, reducer, map after)
_KINDS: dict[str, tuple[Callable | None, Reducer, Callable | None]] = {
    "ReduceSum": (None, _SUM, None),
    "ReduceMean": (None, _plain(_op.mean, np.nan), None),
    "ReduceProd": (None, _plain(_op.prod, 1), None),
    "ReduceMax": (None, _extreme(_op.max, -np.inf), None),
    "ReduceMin": (None, _extreme(_op.min, np.inf), None),
    "ReduceL1": (_op.abs, _SUM, None),
    "ReduceL2": (_op.square, _SUM, _op.sqrt),
    "ReduceSumSquare": (_op.square, _SUM, None),
    "ReduceLogSum": (None, _SUM, _op.log),
    "ReduceLogSumExp": (_op.exp, _SUM, _op.log),
}


def _reduce_if(bb: relax.BlockBuilder, x: relax.Expr, axis: int, chosen: relax.Expr,
               reducer: Reducer) -> relax.Expr:
    """`x` reduced over `axis` (kept as size 1) where the 0-d int64 `chosen` is 1, else `x`.

    Both candidates are concatenated along `axis` and the wanted part sliced out, so an empty
    dimension reduced to size 1 stays correct.
    """
    reduced = reducer(bb, x, [axis], True)
    both = bb.emit(_op.concat([x, reduced], axis=axis))
    size = _op.take(_op.shape_to_tensor(_op.shape_of(x)), const(np.int64(axis)))
    # [begin, end): [size, size + 1) picks the reduced slab, [0, size) the input
    bounds = bb.emit(_op.add(_op.multiply(_op.stack([chosen, chosen], 0),
                                          _op.stack([size, scalar(1, "int64")], 0)),
                             _op.stack([scalar(0, "int64"), size], 0)))
    begin, end = shape_from_tensor(bb, bounds, 2, f"axis{axis}").values
    picked = _op.take(both, _op.arange(begin, end, 1, "int64"), axis=axis)
    return with_fresh_shape(bb, bb.emit(picked), f"reduced{axis}")


def _runtime_axes_reduce(bb: relax.BlockBuilder, op: str, x: relax.Expr, axes: relax.Expr,
                         keepdims: bool, noop_with_empty_axes: bool,
                         reducer: Reducer) -> relax.Expr:
    """`x` reduced over the axes in the run-time tensor `axes`."""
    rank = rank_of(x)
    axes_shape = static_shape(axes)
    if not keepdims and axes_shape is None:
        raise reject(op, "keepdims=0 and run-time axes of unknown length")
    axes = bb.emit(_op.astype(axes, "int64"))
    axes = bb.emit(_op.where(_op.less(axes, scalar(0, "int64")),
                             _op.add(axes, scalar(rank, "int64")), axes))
    hits = bb.emit(_op.equal(_op.expand_dims(axes, 1), const(np.arange(rank, dtype="int64"))))
    hit_count = _SUM(bb, bb.emit(_op.astype(hits, "int64")), [0], False)
    chosen = bb.emit(_op.astype(_op.greater(hit_count, scalar(0, "int64")), "int64"))
    if not noop_with_empty_axes:  # no axes at all: reduce every dimension
        none = _op.equal(_op.take(_op.shape_to_tensor(_op.shape_of(axes)), const(np.int64(0))),
                         scalar(0, "int64"))
        chosen = bb.emit(_op.maximum(chosen, _op.astype(none, "int64")))
    for axis in range(rank):
        x = _reduce_if(bb, x, axis, _op.take(chosen, const(np.int64(axis))), reducer)
    if keepdims:
        return x
    # Output dimension j is the j-th kept input dimension.
    kept = bb.emit(_op.subtract(scalar(1, "int64"), chosen))
    position = bb.emit(_op.subtract(inclusive_cumsum(bb, kept, rank), scalar(1, "int64")))
    out_rank = rank - axes_shape[0]
    picks = bb.emit(_op.multiply(_op.astype(_op.equal(
        _op.expand_dims(position, 0), const(np.arange(out_rank, dtype="int64")[:, None])),
        "int64"), kept))
    source = bb.emit(_op.sum(_op.multiply(picks, const(np.arange(rank, dtype="int64"))), axis=[1]))
    shape = bb.emit(_op.take(_op.shape_to_tensor(_op.shape_of(x)), source, axis=0))
    return bb.emit(_op.reshape(x, shape_from_tensor(bb, shape, out_rank, "reduced")))


class _Reduce(OnnxOpConverter):
    """Shared by every Reduce*: axes from the attribute (old opsets) or the second input."""

    @classmethod
    def _convert(cls, bb, inputs, attr, axes_input: relax.Expr | None) -> relax.Expr:
        op = cls.__name__
        before, reducer, after = _KINDS[op]
        x = inputs[0]
        keepdims = bool(attr.get("keepdims", 1))
        if before is not None:
            x = bb.emit(before(x))
        axes = list(attr.get("axes", []))
        if axes_input is not None:
            value = const_value(axes_input)
            if value is None and static_shape(axes_input) != [0]:
                out = _runtime_axes_reduce(bb, op, x, axes_input, keepdims,
                                           bool(attr.get("noop_with_empty_axes", 0)), reducer)
                return bb.emit(after(out)) if after is not None else out
            axes = [] if value is None else value.tolist()
        if not axes:
            if attr.get("noop_with_empty_axes", 0):
                return inputs[0]
            axes = list(range(rank_of(x)))
        out = reducer(bb, x, normalize_axes(axes, rank_of(x)), keepdims)
        return bb.emit(after(out)) if after is not None else out

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        return cls._convert(bb, inputs, attr, None)

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        return cls._convert(bb, inputs, attr, optional_input(inputs, 1))


class ReduceSum(_Reduce):
    """Takes axes as an input from opset 13."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        return cls._convert(bb, inputs, attr, optional_input(inputs, 1))


class ReduceMean(_Reduce):
    """ReduceMean."""


class ReduceProd(_Reduce):
    """ReduceProd."""


class ReduceMax(_Reduce):
    """ReduceMax; -inf for all -inf or empty rows."""


class ReduceMin(_Reduce):
    """ReduceMin; +inf for all +inf or empty rows."""


class ReduceL1(_Reduce):
    """ReduceL1."""


class ReduceL2(_Reduce):
    """ReduceL2."""


class ReduceSumSquare(_Reduce):
    """ReduceSumSquare."""


class ReduceLogSum(_Reduce):
    """ReduceLogSum."""


class ReduceLogSumExp(_Reduce):
    """ReduceLogSumExp."""
