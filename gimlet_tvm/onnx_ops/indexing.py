"""TopK and OneHot with k / depth constant or given at run time, and ReverseSequence.

A run-time k or depth sets an output dim: it is bound to a fresh symbolic dim
(`shape_from_tensor`), a constant one stays static.
"""

from __future__ import annotations

import numpy as np
from tvm import relax

from ._common import (OnnxOpConverter, const_value, dim_tensor, dtype_of, rank_of, reject, require, scalar,
                      scalar_dim)

_op = relax.op


def _sort_keys(bb: relax.BlockBuilder, data: relax.Expr) -> relax.Expr:
    """`data` in a dtype TVM's sort kernel takes, in the same order: narrower ints as int64,
    uint64 as int64 with the top bit flipped, half floats as float32."""
    dtype = dtype_of(data)
    if dtype in ("float32", "float64", "int32", "int64"):
        return data
    if dtype == "uint64":
        flip = relax.const(np.iinfo("int64").min, "int64")
        return bb.emit(_op.bitwise_xor(_op.astype(data, "int64"), flip))
    return bb.emit(_op.astype(data, "float32" if "float" in dtype else "int64"))


class TopK(OnnxOpConverter):
    """TopK-1/10/11: a stable argsort along the axis (ties keep the lower index first), cut to
    the first k. sorted=0 is served sorted, which ONNX allows."""

    @classmethod
    def _topk(cls, bb, data, k, axis, largest):
        rank = rank_of(data)
        if rank < 1:
            raise reject(cls.__name__, "a 0-d or unknown-rank input")
        axis = axis % rank
        order = bb.emit(_op.argsort(_sort_keys(bb, data), axis, largest, "int64"))
        indices = bb.emit(_op.take(order, _op.arange(0, k, 1, "int64"), axis))
        values = bb.emit(_op.gather_elements(data, indices, axis))
        return relax.Tuple([values, indices])

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        return cls._topk(bb, inputs[0], attr["k"], attr.get("axis", -1), True)

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        data, k, axis = inputs[0], inputs[1], attr.get("axis", -1)
        if const_value(k) is None and rank_of(data) > 0:
            k = bb.emit(_op.reshape(_op.astype(k, "int64"), [1]))
            extent = dim_tensor(data.ty.shape[axis % rank_of(data)])
            k = require(bb, k, _op.logical_and(_op.greater_equal(k, scalar(0, "int64")), _op.less_equal(k, extent)),
                        cls.__name__, "k is outside [0, length of the axis]")
        return cls._topk(bb, data, scalar_dim(bb, k, "topk"), axis, bool(attr.get("largest", 1)))


class OneHot(OnnxOpConverter):
    """OneHot-9/11: negative indices count from depth, out-of-range ones give all off_value;
    indices are compared as numbers (a non-integer float index matches nothing)."""

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        indices, depth, values = inputs
        rank = rank_of(indices)
        if rank < 0:
            raise reject(cls.__name__, "indices of unknown rank")
        axis = attr.get("axis", -1)
        axis = axis + rank + 1 if axis < 0 else axis
        depth_dim = scalar_dim(bb, depth, "onehot")
        positions = _op.arange(0, depth_dim, 1, "float64")
        if rank > axis:
            positions = _op.expand_dims(positions, list(range(1, rank - axis + 1)))
        index = bb.emit(_op.astype(indices, "float64"))
        depth = _op.astype(_op.reshape(depth, []), "float64")
        index = _op.where(_op.less(index, scalar(0.0, "float64")), _op.add(index, depth), index)
        hot = _op.equal(_op.expand_dims(index, axis), positions)
        off = _op.take(values, relax.const(0, "int64"))
        on = _op.take(values, relax.const(1, "int64"))
        return bb.emit(_op.where(hot, on, off))


class ReverseSequence(OnnxOpConverter):
    """ReverseSequence-10: the first seq_lens[b] elements of each batch entry reversed."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        data, lengths = inputs
        return bb.emit(_op.reverse_sequence(data, _op.astype(lengths, "int64"),
                                            attr.get("time_axis", 0), attr.get("batch_axis", 1)))
