"""Reduce* ops: axes as attribute or constant input; -inf/+inf-correct Max/Min.

TVM's max/min reductions start from the lowest/highest finite value, so a row of all -inf
(or an empty row) reduced by max gave -3.4e38 instead of -inf; `_extreme` corrects that.
Axes given at run time (a data-dependent output shape) are refused at import.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from tvm import relax

from ._common import (OnnxOpConverter, const_value, dtype_of, normalize_axes, optional_input,
                      rank_of, reject, scalar, static_shape)

_op = relax.op
Reducer = Callable[[relax.BlockBuilder, relax.Expr, list, bool], relax.Expr]


def _extreme(reduce: Callable, empty_value: float) -> Reducer:
    """A max/min reducer whose result is `empty_value` (-inf/+inf) when nothing else is seen."""

    def reducer(bb: relax.BlockBuilder, x: relax.Expr, axes: list, keepdims: bool) -> relax.Expr:
        result = bb.emit(reduce(x, axes, keepdims))
        dtype = dtype_of(x)
        if not dtype.startswith(("float", "bfloat")):
            return result
        other = bb.emit(_op.astype(_op.not_equal(x, scalar(empty_value, dtype)), "float32"))
        seen = bb.emit(_op.max(other, axes, keepdims))
        return bb.emit(_op.where(_op.greater(seen, scalar(0, "float32")), result,
                                 scalar(empty_value, dtype)))

    return reducer


def _plain(reduce: Callable) -> Reducer:
    return lambda bb, x, axes, keepdims: bb.emit(reduce(x, axes, keepdims))


_SUM = _plain(_op.sum)
# op: (map before, reducer, map after)
_KINDS: dict[str, tuple[Callable | None, Reducer, Callable | None]] = {
    "ReduceSum": (None, _SUM, None),
    "ReduceMean": (None, _plain(_op.mean), None),
    "ReduceProd": (None, _plain(_op.prod), None),
    "ReduceMax": (None, _extreme(_op.max, -np.inf), None),
    "ReduceMin": (None, _extreme(_op.min, np.inf), None),
    "ReduceL1": (_op.abs, _SUM, None),
    "ReduceL2": (_op.square, _SUM, _op.sqrt),
    "ReduceSumSquare": (_op.square, _SUM, None),
    "ReduceLogSum": (None, _SUM, _op.log),
    "ReduceLogSumExp": (_op.exp, _SUM, _op.log),
}


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
                raise reject(op, "axes given at run time (only constant axes are supported)")
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
