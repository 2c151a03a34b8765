"""Det by Gaussian elimination with partial pivoting.

Unrolled over the matrix size, which must be known at import time; any leading batch dims;
computed in float64 and cast back.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ._common import OnnxOpConverter, dtype_of, rank_of, reject, scalar

_op = relax.op


class Det(OnnxOpConverter):
    """Det-11/22 of (..., n, n) floats."""

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        x = inputs[0]
        dtype = dtype_of(x)
        shape = x.ty.shape
        size = shape.values[-1] if shape is not None and rank_of(x) >= 2 else None
        if not isinstance(size, tvm.tirx.IntImm):
            raise reject(cls.__name__, "a matrix size unknown at import time")
        n = int(size)
        work = "float64"
        a = bb.emit(_op.astype(x, work))
        rows = relax.const(list(range(n)), "int64")  # (n,)
        det = None
        for k in range(n):
            col = _op.take(a, relax.const(k, "int64"), axis=-1)  # (..., n)
            below = _op.greater_equal(rows, relax.const(k, "int64"))
            candidates = _op.where(below, _op.abs(col), scalar(-1, work))
            pivot = bb.emit(_op.argmax(candidates, axis=-1, keepdims=True))  # (..., 1)
            k_ = relax.const(k, "int64")
            order = _op.where(_op.equal(rows, k_), pivot,
                              _op.where(_op.equal(rows, pivot), k_, rows))  # (..., n)
            index = _op.broadcast_to(_op.expand_dims(order, -1), a.ty.shape)
            a = bb.emit(_op.gather_elements(a, index, axis=-2))
            diagonal = bb.emit(_op.take(_op.take(a, k_, axis=-1), relax.const([k], "int64"),
                                        axis=-1))  # (..., 1)
            swapped = _op.where(_op.equal(pivot, k_), scalar(1, work), scalar(-1, work))
            factor = _op.multiply(diagonal, swapped)
            det = bb.emit(factor if det is None else _op.multiply(det, factor))
            safe = _op.where(_op.equal(diagonal, scalar(0, work)), scalar(1, work), diagonal)
            multipliers = _op.where(_op.greater(rows, k_),
                                    _op.divide(_op.take(a, k_, axis=-1), safe), scalar(0, work))
            pivot_row = _op.take(a, relax.const([k], "int64"), axis=-2)  # (..., 1, n)
            a = bb.emit(_op.subtract(a, _op.multiply(_op.expand_dims(multipliers, -1),
                                                     pivot_row)))
        return bb.emit(_op.astype(_op.squeeze(det, [-1]), dtype))

