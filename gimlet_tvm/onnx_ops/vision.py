"""AffineGrid with a constant or run-time size, TensorScatter (KV-cache writes),
NonMaxSuppression, RoiAlign in max mode."""

from __future__ import annotations

import numpy as np
from tvm import relax, te, tirx, topi
from tvm.relax.frontend.onnx import onnx_frontend

from ._common import (OnnxOpConverter, const, const_value, dtype_of, normalize_axes,
                      optional_input, rank_of, reject, scalar, shape_from_tensor, static_shape,
                      text_attr)

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
        mode = text_attr(attr, "mode", "linear")
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


def _sample_axis(start: relax.Expr, bin_size: relax.Expr, pooled: int, grid: int, size: int,
                 dtype: str) -> tuple[relax.Expr, ...]:
    """Along one axis of RoiAlign's sampling grid ([R, pooled * grid] points per ROI): whether
    each point is inside (-1 <= p <= size), its low and high pixel and their weights."""
    steps = np.array([p + (i + 0.5) / grid for p in range(pooled) for i in range(grid)], dtype)
    point = _op.add(_op.expand_dims(start, 1),
                    _op.multiply(const(steps), _op.expand_dims(bin_size, 1)))
    inside = _op.logical_and(_op.greater_equal(point, scalar(-1, dtype)),
                             _op.less_equal(point, scalar(size, dtype)))
    point = _op.maximum(point, scalar(0, dtype))
    low = _op.floor(point)
    last = scalar(size - 1, dtype)
    at_edge = _op.greater_equal(low, last)
    low = _op.where(at_edge, last, low)
    point = _op.where(at_edge, last, point)
    high = _op.where(at_edge, last, _op.add(low, scalar(1, dtype)))
    frac = _op.subtract(point, low)
    return inside, _op.astype(low, "int64"), _op.astype(high, "int64"), \
        _op.subtract(scalar(1, dtype), frac), frac


class RoiAlign(OnnxOpConverter):
    """RoiAlign-10/16. mode='max' as ONNX's reference and onnxruntime define it: per sample
    point the largest of the four weighted corner pixels, then the largest over the bin's
    sampling_ratio x sampling_ratio points (sampling_ratio 0, adaptive per ROI, is refused);
    mode='avg' goes to TVM's converter."""

    @classmethod
    def get_converter(cls, opset: int):
        tvm_convert = onnx_frontend.RoiAlign.get_converter(opset)
        default_mode = b"half_pixel" if opset >= 16 else b"output_half_pixel"

        def convert(bb, inputs, attr, params):
            if attr.get("mode", b"avg") not in (b"max", "max"):
                return tvm_convert(bb, inputs, attr, params)
            return cls._max(bb, inputs, attr, default_mode)

        return convert

    @classmethod
    def _max(cls, bb: relax.BlockBuilder, inputs: list, attr: dict, default_mode: bytes):
        x, rois, batch_indices = inputs
        grid = int(attr.get("sampling_ratio", 0))
        shape = static_shape(x)
        if grid <= 0 or shape is None:
            raise reject(cls.__name__, "mode='max' with sampling_ratio 0 or a run-time shape")
        _, channels, height, width = shape
        pooled_h, pooled_w = int(attr.get("output_height", 1)), int(attr.get("output_width", 1))
        dtype = dtype_of(x)
        half_pixel = attr.get("coordinate_transformation_mode", default_mode) in (
            b"half_pixel", "half_pixel")
        corners = _op.subtract(_op.multiply(rois, scalar(float(attr.get("spatial_scale", 1.0)),
                                                         dtype)),
                               scalar(0.5 if half_pixel else 0.0, dtype))
        corners = bb.emit(corners)
        coord = lambda k: _op.take(corners, const(np.int64(k)), axis=1)  # noqa: E731
        sizes = []
        for k in (0, 1):  # x, y
            size = _op.subtract(coord(k + 2), coord(k))
            sizes.append(size if half_pixel else _op.maximum(size, scalar(1, dtype)))
        ys = _sample_axis(coord(1), _op.divide(sizes[1], scalar(pooled_h, dtype)), pooled_h,
                          grid, height, dtype)
        xs = _sample_axis(coord(0), _op.divide(sizes[0], scalar(pooled_w, dtype)), pooled_w,
                          grid, width, dtype)
        ys = [bb.emit(_op.expand_dims(v, 2)) for v in ys]  # [R, SY, 1]
        xs = [bb.emit(_op.expand_dims(v, 1)) for v in xs]  # [R, 1, SX]
        inside = _op.logical_and(ys[0], xs[0])
        images = _op.reshape(bb.emit(_op.take(x, _op.astype(batch_indices, "int64"), axis=0)),
                             [-1, channels, height * width])
        images = bb.emit(images)
        points = pooled_h * grid * pooled_w * grid
        candidates = []
        for y_index, y_weight in ((ys[1], ys[3]), (ys[2], ys[4])):
            for x_index, x_weight in ((xs[1], xs[3]), (xs[2], xs[4])):
                flat = _op.reshape(bb.emit(_op.add(_op.multiply(y_index, scalar(width, "int64")),
                                                   x_index)), [-1, 1, points])
                index = _op.broadcast_to(flat, [images.ty.shape.values[0], channels, points])
                pixels = _op.gather_elements(images, bb.emit(index), axis=2)
                weight = _op.reshape(bb.emit(_op.multiply(y_weight, x_weight)), [-1, 1, points])
                candidates.append(bb.emit(_op.multiply(weight, pixels)))
        best = candidates[0]
        for other in candidates[1:]:
            best = _op.maximum(best, other)
        best = _op.where(_op.reshape(bb.emit(inside), [-1, 1, points]), best, scalar(0, dtype))
        best = _op.reshape(bb.emit(best), [-1, channels, pooled_h, grid, pooled_w, grid])
        return _op.max(best, axis=[3, 5])
