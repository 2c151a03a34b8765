"""MaxPool's Indices output; MaxPool with one output goes to TVM's converter.

Indices: for each kernel offset (in the reference's scan order) the candidate input element of
every output position is gathered; the first valid candidate equal to the pooled maximum gives
the flat input index (row-major, or column-major over the spatial dims for storage_order=1).
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from ._common import OnnxOpConverter, const, reject, scalar, static_shape, text_attr

_op = relax.op


def _indices(bb: relax.BlockBuilder, x: relax.Expr, pooled: relax.Expr, attr: dict,
             shape: list[int], out_shape: list[int]) -> relax.Expr:
    spatial = len(shape) - 2
    kernel = list(attr["kernel_shape"])
    strides = list(attr.get("strides", [1] * spatial))
    dilations = list(attr.get("dilations", [1] * spatial))
    begin = list(attr.get("pads", [0] * 2 * spatial))[:spatial]
    lengths = shape[2:]
    if attr.get("storage_order", 0):
        weights = np.cumprod([1] + lengths[:-1])
    else:
        weights = np.cumprod([1] + lengths[::-1][:-1])[::-1]
    found = None
    index = None
    for offsets in itertools.product(*(range(k) for k in kernel)):
        candidate, valid, flat = x, np.ones(out_shape[2:], bool), 0
        for d, k in enumerate(offsets):
            pos = np.arange(out_shape[2 + d]) * strides[d] + k * dilations[d] - begin[d]
            inside = (pos >= 0) & (pos < lengths[d])
            grid = [1] * spatial
            grid[d] = -1
            valid = valid & inside.reshape(grid)
            flat = flat + (pos * weights[d]).reshape(grid)
            candidate = _op.take(candidate, const(np.clip(pos, 0, lengths[d] - 1)), 2 + d)
        hit = _op.logical_and(_op.equal(candidate, pooled), const(valid))
        flat = const(np.broadcast_to(flat, out_shape[2:]).astype("int64"))
        if found is None:
            index = bb.emit(_op.where(hit, flat, scalar(-1, "int64")))
            found = bb.emit(hit)
        else:
            index = bb.emit(_op.where(_op.logical_and(hit, _op.logical_not(found)), flat, index))
            found = bb.emit(_op.logical_or(found, hit))
    plane = int(np.prod(lengths))
    channel = np.arange(shape[0] * shape[1], dtype="int64").reshape(shape[:2] + [1] * spatial)
    return bb.emit(_op.add(index, const(channel * plane)))


class MaxPool(OnnxOpConverter):
    """MaxPool with the Indices output (explicit pads, static shapes); one output: TVM's."""

    @classmethod
    def get_converter(cls, opset: int) -> Callable:
        tvm_convert = onnx_frontend.MaxPool.get_converter(opset)

        def convert(bb, inputs, attr, params):
            pooled = tvm_convert(bb, inputs, attr, params)
            if attr["tvm_custom"]["num_outputs"] < 2:
                return pooled
            x = inputs[0]
            auto_pad = text_attr(attr, "auto_pad", "NOTSET")
            if auto_pad not in ("NOTSET", "VALID"):
                raise reject(cls.__name__, f"auto_pad={auto_pad} and the Indices output")
            pooled = bb.emit(pooled)
            shape, out_shape = static_shape(x), static_shape(pooled)
            if shape is None or out_shape is None:
                raise reject(cls.__name__, "the Indices output of a dynamic-shape input")
            return relax.Tuple([pooled, _indices(bb, x, pooled, attr, shape, out_shape)])

        return convert

