"""AffineGrid with a constant or run-time size, TensorScatter (KV-cache writes)."""

from __future__ import annotations

import numpy as np
from tvm import relax, te, tirx, topi

from ._common import (OnnxOpConverter, const, const_value, dtype_of, normalize_axes,
                      optional_input, rank_of, reject, scalar, shape_from_tensor, static_shape)

_op = relax.op


def _coordinates(size: relax.Expr, length, align_corners: bool, dtype: str) -> relax.Expr:
    """The normalized [-1, 1] coordinates of `length` points (`size`: the same length as a
    0-d tensor): pixel centres, or the corners with align_corners (one point: -1)."""
    index = _op.astype(_op.arange(0, length, 1, "int64"), dtype)
    size = _op.astype(size, dtype)
    one, two = scalar(1, dtype), scalar(2, dtype)
    if align_corners:
        steps = _op.maximum(_op.subtract(size, one), one)
        return _op.subtract(_op.divide(_op.multiply(two, index), steps), one)
    return _op.subtract(_op.divide(_op.add(_op.multiply(two, index), one), size), one)


class AffineGrid(OnnxOpConverter):
    """AffineGrid-20 (2-D and 3-D): theta applied to the homogeneous grid [x, y, (z,) 1];
    the size may be known only at run time. Half precision is computed in float32."""

    @classmethod
    def _impl_v20(cls, bb, inputs, attr, params):
        theta, size = inputs
        length = static_shape(size)
        if length is None or length[0] not in (4, 5):
            raise reject(cls.__name__, "a size of unknown length")
        spatial = length[0] - 2
        dtype = dtype_of(theta)
        compute = "float32" if dtype in ("float16", "bfloat16") else dtype
        size = bb.emit(_op.astype(size, "int64"))
        value = const_value(size)
        dims = ([int(v) for v in value] if value is not None
                else list(shape_from_tensor(bb, size, spatial + 2, "affine_grid").values))
        axes = []  # per spatial dim, its coordinates broadcast to the grid's shape
        grid_shape = dims[2:]
        for k in range(spatial):
            coords = _coordinates(_op.take(size, const(np.int64(k + 2))), dims[k + 2],
                                  bool(attr.get("align_corners", 0)), compute)
            shape = [1] * spatial
            shape[k] = dims[k + 2]
            axes.append(_op.broadcast_to(_op.reshape(coords, shape), grid_shape))
        ones = _op.ones(grid_shape, compute)
        # the homogeneous vector is x (last dim) first
        base = bb.emit(_op.stack(list(reversed(axes)) + [ones], axis=-1))
        base = _op.expand_dims(base, 0)  # [1, *spatial, spatial + 1]
        matrix = bb.emit(_op.permute_dims(_op.astype(theta, compute), [0, 2, 1]))
        matrix = _op.reshape(matrix, [-1] + [1] * (spatial - 1) + [spatial + 1, spatial])
        grid = _op.matmul(base, bb.emit(matrix))  # [N, *spatial, spatial]
        return _op.astype(grid, dtype)


class TensorScatter(OnnxOpConverter):
    """TensorScatter-24: `update` written into `past_cache` along `axis` from each batch's
    write index (mode 'linear', or 'circular' wrapping around the cache length). Every
    cache position reads the update element it receives, if any (no scatter kernel)."""

    @classmethod
    def _impl_v24(cls, bb, inputs, attr, params):
        past, update = inputs[0], inputs[1]
        rank = rank_of(past)
        axis = normalize_axes([attr.get("axis", -2)], rank)[0]
        mode = attr.get("mode", b"linear")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        if axis == 0 or mode not in ("linear", "circular"):
            raise reject(cls.__name__, f"axis 0 or mode {mode}")
        past_dims = past.ty.shape.values
        lengths = [past_dims[axis], update.ty.shape.values[axis]]
        if not all(isinstance(n, tirx.IntImm) for n in lengths):
            raise reject(cls.__name__, "a run-time cache or update length")
        cache_length, update_length = (int(n) for n in lengths)
        indices = optional_input(inputs, 2)
        batch = past_dims[0]
        start = (_op.zeros([batch], "int64") if indices is None
                 else _op.astype(indices, "int64"))
        position = _op.arange(0, cache_length, 1, "int64")
        # offset[b, s]: which update row cache row s of batch b receives
        offset = _op.subtract(_op.expand_dims(position, 0), _op.expand_dims(start, 1))
        if mode == "circular":
            offset = _op.floor_mod(offset, scalar(cache_length, "int64"))
        offset = bb.emit(offset)
        written = _op.logical_and(_op.greater_equal(offset, scalar(0, "int64")),
                                  _op.less(offset, scalar(update_length, "int64")))
        # [B, S] -> [B, 1, ..., S, 1, ...] against the cache
        shape = [batch] + [1] * (rank - 1)
        shape[axis] = cache_length
        offset = _op.reshape(offset, shape)
        written = _op.reshape(written, shape)
        source = _op.clip(offset, 0, update_length - 1)
        gather_shape = list(past_dims)
        gather_shape[axis] = cache_length
        rows = _op.gather_elements(update, _op.broadcast_to(source, gather_shape), axis)
        return _op.where(written, bb.emit(rows), past)


def _threshold(value: relax.Expr | None, default: float, dtype: str) -> relax.Expr:
    """A 0-d `dtype` tensor of an optional threshold input (constant or run-time)."""
    if value is None:
        return scalar(default, dtype)
    return _op.reshape(_op.astype(value, dtype), [])


def _next_float(t: te.Tensor) -> te.Tensor:
    """The float32 after each non-negative `t`: TOPI suppresses at IoU >= its threshold, ONNX
    at IoU > threshold (and TOPI suppresses nothing for a threshold of 0)."""
    return te.compute(t.shape, lambda *i: tirx.reinterpret(
        "float32", tirx.reinterpret("int32", t(*i)) + 1), name="next_float")


class NonMaxSuppression(OnnxOpConverter):
    """NonMaxSuppression-10+ by TOPI's all-class NMS kernel (every batch and class), its
    padded [batch * classes * boxes, 3] result cut to the run-time count of selected boxes.
    center_point_box=1 boxes are converted to corners first; max_output_boxes_per_class,
    iou_threshold and score_threshold may be run-time inputs."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        boxes, scores = inputs[0], inputs[1]
        limit = optional_input(inputs, 2)
        if limit is None:  # the default 0 selects nothing
            return const(np.zeros((0, 3), "int64"))
        limit = bb.emit(_op.maximum(_op.reshape(_op.astype(limit, "int64"), [1]),
                                    scalar(0, "int64")))
        if attr.get("center_point_box", 0):
            centre = _op.strided_slice(boxes, [2], [0], [2])
            half = _op.multiply(_op.strided_slice(boxes, [2], [2], [4]),
                                scalar(0.5, dtype_of(boxes)))
            boxes = bb.emit(_op.concat([_op.subtract(centre, half), _op.add(centre, half)],
                                       axis=2))
        iou = bb.emit_te(_next_float, bb.emit(_op.maximum(
            _threshold(optional_input(inputs, 3), 0.0, "float32"), scalar(0, "float32"))))
        score = bb.emit(_threshold(optional_input(inputs, 4), float("-inf"), "float32"))
        shape = static_shape(scores)
        if shape is not None and shape[0] * shape[1] == 1:
            # TVM's lowering of the kernel fails for one (batch, class) pair: add a class
            # that selects nothing (every score -inf, never above the threshold)
            nothing = const(np.full(shape, -np.inf, dtype_of(scores)))
            scores = bb.emit(_op.concat([scores, nothing], axis=1))
        result = bb.emit_te(topi.vision.all_class_non_max_suppression, boxes, scores,
                            limit, iou, score, "onnx")
        selected = bb.emit(relax.TupleGetItem(result, 0))
        count = bb.emit(_op.astype(relax.TupleGetItem(result, 1), "int64"))
        rows = shape_from_tensor(bb, count, 1, "nms").values[0]
        return _op.take(selected, _op.arange(0, rows, 1, "int64"), axis=0)
