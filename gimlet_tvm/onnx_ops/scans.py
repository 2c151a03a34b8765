"""CumSum and CumProd (exclusive, reverse), with the axis constant or given at run time.

A run-time axis can only be one of the input's dims: the scan is built along each of them
and the one the axis names is selected (the output shape is the input's either way).
The scans are TOPI's generic kernels (`emit_te`): Relax's cumsum/cumprod are only lowered by
TVM's DispatchSortScan pass, which our pipeline does not run.
"""

from __future__ import annotations

from typing import Callable

from tvm import relax, topi

from ._common import OnnxOpConverter, const_value, rank_of, reject, scalar

_op = relax.op


def _scan(bb: relax.BlockBuilder, op: Callable, data: relax.Expr, axis: int, exclusive: bool,
          reverse: bool) -> relax.Expr:
    if reverse:
        data = bb.emit(_op.flip(data, axis))
    out = bb.emit_te(op, data, axis, None, exclusive)
    return bb.emit(_op.flip(out, axis)) if reverse else out


class _Cumulative(OnnxOpConverter):
    """A running reduction (`scan_op`, a TOPI scan) along the axis given by the second input."""

    scan_op: Callable

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        data, axis = inputs[0], inputs[1]
        rank = rank_of(data)
        if rank < 1:
            raise reject(cls.__name__, "a 0-d or unknown-rank input")
        exclusive = bool(attr.get("exclusive", 0))
        reverse = bool(attr.get("reverse", 0))
        scan = lambda d: _scan(bb, cls.scan_op, data, d, exclusive, reverse)  # noqa: E731
        fixed = const_value(axis)
        if fixed is not None:
            return scan(int(fixed.reshape(-1)[0]) % rank)
        axis = _op.astype(_op.reshape(axis, []), "int64")
        axis = bb.emit(_op.where(_op.less(axis, scalar(0, "int64")),
                                 _op.add(axis, scalar(rank, "int64")), axis))
        out = scan(rank - 1)
        for d in reversed(range(rank - 1)):
            out = bb.emit(_op.where(_op.equal(axis, scalar(d, "int64")), scan(d), out))
        return out


class CumSum(_Cumulative):
    """Running sum (CumSum-11/14)."""

    scan_op = staticmethod(topi.cumsum)


class CumProd(_Cumulative):
    """Running product (CumProd-26)."""

    scan_op = staticmethod(topi.cumprod)
