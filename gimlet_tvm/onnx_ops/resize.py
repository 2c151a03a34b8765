"""Resize (opsets 10-19+) and Upsample, with scales, sizes and roi constant or given at run time.

Each resized axis is interpolated on its own, as ONNX's reference does: the source coordinate
of every output position is computed in float64 from the axis' scale (not from the ratio of
the lengths, which differs when `length * scale` is not an integer), the taps around it are
gathered with `take` (indices clamped to the edge) and weighted. Antialiasing widens the
filter by 1/scale when downsampling; the number of taps then depends on the scale and, for a
run-time scale, is a symbolic dim. Output lengths known at import time stay static; run-time
ones are bound to fresh symbolic dims.

Handled: modes nearest (all nearest_mode values), linear and cubic (cubic_coeff_a,
exclude_outside, antialias), every coordinate_transformation_mode, the axes attribute and
keep_aspect_ratio_policy. Refused: linear/cubic on integer tensors, antialias with nearest.
"""

from __future__ import annotations

import math

import numpy as np
from tvm import relax, tirx

from ._common import (OnnxOpConverter, const, const_value, dtype_of, normalize_axes,
                      optional_input, rank_of, reject, require, scalar, shape_from_tensor, static_shape,
                      text_attr)

_op = relax.op
_F64 = "float64"
# Half-width of each filter (in input pixels at scale 1).
_SUPPORT = {"linear": 1, "cubic": 2}


def _f64(value: float) -> relax.Expr:
    return scalar(value, _F64)


def _i64(value: int) -> relax.Expr:
    return scalar(value, "int64")


def _present(expr: relax.Expr | None) -> bool:
    """Whether an optional input is given and not an empty tensor."""
    return expr is not None and static_shape(expr) != [0]


class _Plan:
    """Per resized axis: its scale (float64) and input and output lengths; import-time values
    where scales/sizes are constants and the input shape is static, else Relax tensors of
    shape [len(axes)] (the output lengths bound to fresh symbolic dims)."""

    def __init__(self, bb: relax.BlockBuilder, x: relax.Expr, axes: list[int],
                 scales: relax.Expr | None, sizes: relax.Expr | None, policy: str):
        self.bb = bb
        in_shape = static_shape(x)
        lengths = None if in_shape is None else np.array([in_shape[a] for a in axes], "int64")
        scales_c = None if scales is None else const_value(scales)
        sizes_c = None if sizes is None else const_value(sizes)
        if lengths is not None and (scales_c is not None or sizes_c is not None):
            self.scale, out = self._static(lengths, scales_c, sizes_c, policy)
            self.length, self.out = lengths, [int(v) for v in out]
            return
        all_lengths = bb.emit(_op.shape_to_tensor(_op.shape_of(x)))
        self.length = bb.emit(_op.take(all_lengths, const(np.array(axes, "int64"))))
        self.scale, out = self._runtime(bb, self.length, scales, sizes, policy)
        self.out = list(shape_from_tensor(bb, out, len(axes), "resize").values)

    def is_identity(self, i: int) -> bool:
        """Whether axis `i` is known at import time to keep its length at scale 1."""
        return (isinstance(self.scale, np.ndarray) and self.scale[i] == 1.0
                and self.out[i] == self.length[i])

    def axis_scale(self, i: int) -> relax.Expr:
        if isinstance(self.scale, np.ndarray):
            return _f64(float(self.scale[i]))
        return self.bb.emit(_op.take(self.scale, const(np.int64(i))))

    def axis_length(self, i: int) -> relax.Expr:
        if isinstance(self.length, np.ndarray):
            return _i64(int(self.length[i]))
        return self.bb.emit(_op.take(self.length, const(np.int64(i))))

    @staticmethod
    def _static(lengths: np.ndarray, scales: np.ndarray | None, sizes: np.ndarray | None,
                policy: str) -> tuple[np.ndarray, np.ndarray]:
        if scales is not None:
            scale = scales.astype(_F64)
            return scale, np.floor(scale * lengths).astype("int64")
        scale = sizes.astype(_F64) / lengths
        if policy == "stretch":
            return scale, sizes.astype("int64")
        scale = np.full_like(scale, scale.min() if policy == "not_larger" else scale.max())
        return scale, np.floor(scale * lengths + 0.5).astype("int64")

    @staticmethod
    def _runtime(bb: relax.BlockBuilder, lengths: relax.Expr, scales: relax.Expr | None,
                 sizes: relax.Expr | None, policy: str) -> tuple[relax.Expr, relax.Expr]:
        flengths = _op.astype(lengths, _F64)
        if scales is not None:
            scale = bb.emit(_op.astype(scales, _F64))
            scale = require(bb, scale, _op.greater(scale, _f64(0.0)), "Resize", "a scale is not above 0")
            return scale, bb.emit(_op.astype(_op.floor(_op.multiply(scale, flengths)), "int64"))
        scale = bb.emit(_op.divide(_op.astype(sizes, _F64), flengths))
        if policy == "stretch":
            return scale, bb.emit(_op.astype(sizes, "int64"))
        pick = _op.min if policy == "not_larger" else _op.max
        scale = bb.emit(_op.full_like(scale, pick(scale)))
        out = _op.floor(_op.add(_op.multiply(scale, flengths), _f64(0.5)))
        return scale, bb.emit(_op.astype(out, "int64"))


def _source_coordinates(bb: relax.BlockBuilder, out: tirx.PrimExpr | int, scale: relax.Expr,
                        length: relax.Expr, mode: str, roi: tuple[relax.Expr, relax.Expr] | None
                        ) -> tuple[relax.Expr, relax.Expr | None]:
    """Float64 input coordinate of each output position along one axis, and for
    tf_crop_and_resize the mask of positions outside the input (else None)."""
    y = _op.arange(0, out, 1, _F64)
    flength = bb.emit(_op.astype(length, _F64))
    width = bb.emit(_op.multiply(scale, flength))  # the reference's float output width
    single = _op.equal(width, _f64(1.0))
    last = _op.subtract(flength, _f64(1.0))
    half_pixel = _op.subtract(_op.divide(_op.add(y, _f64(0.5)), scale), _f64(0.5))
    if mode == "half_pixel":
        x = half_pixel
    elif mode == "half_pixel_symmetric":
        adjustment = _op.divide(_op.astype(_op.astype(width, "int64"), _F64), width)
        offset = _op.multiply(_op.divide(flength, _f64(2.0)), _op.subtract(_f64(1.0), adjustment))
        x = _op.add(offset, half_pixel)
    elif mode == "pytorch_half_pixel":
        x = _op.where(single, _f64(-0.5), half_pixel)
    elif mode == "asymmetric":
        x = _op.divide(y, scale)
    elif mode == "align_corners":
        step = _op.divide(last, _op.subtract(width, _f64(1.0)))
        x = _op.where(single, _f64(0.0), _op.multiply(y, step))
    elif mode == "tf_crop_and_resize":
        start, end = roi
        span = _op.multiply(_op.subtract(end, start), last)
        inner = _op.multiply(y, _op.divide(span, _op.subtract(width, _f64(1.0))))
        x = bb.emit(_op.add(_op.where(single, _op.divide(span, _f64(2.0)), inner),
                            _op.multiply(start, last)))
        outside = _op.logical_or(_op.less(x, _f64(0.0)), _op.greater(x, last))
        return x, bb.emit(outside)
    else:
        raise reject("Resize", f"coordinate_transformation_mode={mode!r}")
    return bb.emit(x), None


def _nearest_index(bb: relax.BlockBuilder, x: relax.Expr, scale: relax.Expr,
                   mode: str) -> relax.Expr:
    """The input index nearest_mode picks for coordinate `x` ('simple': Resize-10/Upsample,
    floor when upsampling and ceil when downsampling, as onnxruntime does)."""
    low = bb.emit(_op.floor(x))
    frac = _op.subtract(x, low)
    high = _op.add(low, _f64(1.0))
    if mode == "round_prefer_floor":
        index = _op.where(_op.less_equal(frac, _f64(0.5)), low, high)
    elif mode == "round_prefer_ceil":
        index = _op.where(_op.less(frac, _f64(0.5)), low, high)
    elif mode == "floor":
        index = low
    elif mode == "ceil":
        index = _op.ceil(x)
    elif mode == "simple":
        index = _op.where(_op.less(scale, _f64(1.0)), _op.ceil(x), low)
    else:
        raise reject("Resize", f"nearest_mode={mode!r}")
    return bb.emit(_op.astype(index, "int64"))


def _filter(distance: relax.Expr, mode: str, cubic_a: float) -> relax.Expr:
    """The linear (triangle) or cubic (Keys, parameter a) kernel at float64 `distance`."""
    d = _op.abs(distance)
    if mode == "linear":
        return _op.maximum(_op.subtract(_f64(1.0), d), _f64(0.0))
    a = cubic_a
    d2 = _op.multiply(d, d)
    d3 = _op.multiply(d2, d)
    near = _op.add(_op.subtract(_op.multiply(_f64(a + 2), d3), _op.multiply(_f64(a + 3), d2)),
                   _f64(1.0))
    far = _op.add(_op.subtract(_op.multiply(_f64(a), d3), _op.multiply(_f64(5 * a), d2)),
                  _op.subtract(_op.multiply(_f64(8 * a), d), _f64(4 * a)))
    return _op.where(_op.less_equal(d, _f64(1.0)), near,
                     _op.where(_op.less(d, _f64(2.0)), far, _f64(0.0)))


def _weighted_taps(bb: relax.BlockBuilder, x: relax.Expr, scale: relax.Expr, mode: str,
                   cubic_a: float, antialias: bool) -> tuple[relax.Expr, relax.Expr]:
    """Unclamped input indices [out, n] around each coordinate of `x` and their filter
    weights (not normalized): the n integers j with -n/2 <= j - x < n/2, where
    n = 2 * ceil(support / filter scale) covers the filter's whole support."""
    support = _SUPPORT[mode]
    fixed = const_value(scale) if antialias else 1.0
    if fixed is not None:
        fixed = min(float(fixed), 1.0)
        filter_scale = _f64(fixed)
        n = 2 * math.ceil(support / fixed)
        half = _f64(n / 2)
    else:
        filter_scale = bb.emit(_op.minimum(scale, _f64(1.0)))
        count = bb.emit(_op.multiply(_op.ceil(_op.divide(_f64(support), filter_scale)),
                                     _f64(2.0)))
        n_tensor = bb.emit(_op.reshape(_op.astype(count, "int64"), [1]))
        n = shape_from_tensor(bb, n_tensor, 1, "resize_taps").values[0]
        half = _op.divide(count, _f64(2.0))
    first = _op.ceil(_op.subtract(x, half))
    j = bb.emit(_op.add(_op.expand_dims(first, 1),
                        _op.expand_dims(_op.arange(0, n, 1, _F64), 0)))
    distance = _op.multiply(_op.subtract(j, _op.expand_dims(x, 1)), filter_scale)
    return bb.emit(_op.astype(j, "int64")), bb.emit(_filter(distance, mode, cubic_a))


class _Attrs:
    """The attributes that shape the interpolation, with their opset defaults."""

    def __init__(self, attr: dict, legacy: bool):
        self.mode = text_attr(attr, "mode", "nearest")
        # Resize-10 and Upsample: asymmetric coordinates, onnxruntime's 'simple' rounding.
        self.coordinates = ("asymmetric" if legacy else
                            text_attr(attr, "coordinate_transformation_mode", "half_pixel"))
        self.nearest_mode = "simple" if legacy else text_attr(attr, "nearest_mode",
                                                               "round_prefer_floor")
        self.cubic_a = float(attr.get("cubic_coeff_a", -0.75))
        self.exclude_outside = bool(attr.get("exclude_outside", 0))
        self.extrapolation_value = float(attr.get("extrapolation_value", 0.0))
        self.antialias = bool(attr.get("antialias", 0))
        self.policy = text_attr(attr, "keep_aspect_ratio_policy", "stretch")


def _resize_axis(bb: relax.BlockBuilder, data: relax.Expr, axis: int, out: tirx.PrimExpr | int,
                 scale: relax.Expr, length: relax.Expr, attrs: _Attrs,
                 roi: tuple[relax.Expr, relax.Expr] | None) -> relax.Expr:
    """`data` resized along `axis` to `out` positions."""
    x, outside = _source_coordinates(bb, out, scale, length, attrs.coordinates, roi)
    last = bb.emit(_op.subtract(length, _i64(1)))
    trailing = list(range(1, rank_of(data) - axis))
    if attrs.mode == "nearest":
        index = _nearest_index(bb, x, scale, attrs.nearest_mode)
        result = bb.emit(_op.take(data, _op.minimum(_op.maximum(index, _i64(0)), last), axis))
    else:
        j, weights = _weighted_taps(bb, x, scale, attrs.mode, attrs.cubic_a, attrs.antialias)
        if attrs.exclude_outside:
            inside = _op.logical_and(_op.greater_equal(j, _i64(0)), _op.less_equal(j, last))
            weights = bb.emit(_op.where(inside, weights, _f64(0.0)))
        if attrs.exclude_outside or attrs.antialias:
            total = _op.sum(weights, axis=[1], keepdims=True)
            weights = bb.emit(_op.divide(weights, _op.where(_op.equal(total, _f64(0.0)),
                                                            _f64(1.0), total)))
        gathered = _op.take(data, _op.minimum(_op.maximum(j, _i64(0)), last), axis)
        weights = _op.astype(weights, dtype_of(data))
        if trailing:
            weights = _op.expand_dims(weights, [a + 1 for a in trailing])
        result = bb.emit(_op.sum(_op.multiply(gathered, weights), axis=[axis + 1]))
    if outside is None:
        return result
    mask = _op.expand_dims(outside, trailing) if trailing else outside
    fill = scalar(attrs.extrapolation_value, dtype_of(data))
    return bb.emit(_op.where(mask, fill, result))


def _resize(bb: relax.BlockBuilder, x: relax.Expr, roi: relax.Expr | None,
            scales: relax.Expr | None, sizes: relax.Expr | None, attr: dict,
            legacy: bool = False) -> relax.Expr:
    op = "Resize"
    attrs = _Attrs(attr, legacy)
    dtype = dtype_of(x)
    rank = rank_of(x)
    if attrs.mode not in ("nearest", *_SUPPORT):
        raise reject(op, f"mode={attrs.mode!r}")
    if attrs.antialias and attrs.mode == "nearest":
        raise reject(op, "antialias=1 and mode='nearest'")
    if attrs.mode != "nearest" and not dtype.startswith("float"):
        raise reject(op, f"mode={attrs.mode!r} on {dtype}")
    if attrs.policy not in ("stretch", "not_larger", "not_smaller"):
        raise reject(op, f"keep_aspect_ratio_policy={attrs.policy!r}")
    scales = scales if _present(scales) else None
    sizes = sizes if _present(sizes) else None
    if (scales is None) == (sizes is None):
        raise reject(op, "both or neither of scales and sizes")
    if rank < 0:
        raise reject(op, "an input of unknown rank")
    axes = normalize_axes(attr.get("axes", range(rank)), rank)
    plan = _Plan(bb, x, axes, scales, sizes, attrs.policy)
    if attrs.coordinates == "tf_crop_and_resize":
        if not _present(roi):
            raise reject(op, "tf_crop_and_resize without roi")
        roi = bb.emit(_op.astype(roi, _F64))

    compute = dtype if dtype in ("float32", "float64") or attrs.mode == "nearest" else "float32"
    data = x if compute == dtype else bb.emit(_op.astype(x, compute))
    for i, axis in enumerate(axes):
        axis_roi = None
        if attrs.coordinates == "tf_crop_and_resize":
            axis_roi = (bb.emit(_op.take(roi, const(np.int64(i)))),
                        bb.emit(_op.take(roi, const(np.int64(len(axes) + i)))))
        elif plan.is_identity(i):
            continue
        data = _resize_axis(bb, data, axis, plan.out[i], plan.axis_scale(i),
                            plan.axis_length(i), attrs, axis_roi)
    return data if compute == dtype else bb.emit(_op.astype(data, dtype))


class Resize(OnnxOpConverter):
    """Resize-10 (X, scales) and Resize-11+ (X, roi, scales, sizes); see the module doc."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        return _resize(bb, inputs[0], None, inputs[1], None, attr, legacy=True)

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        return _resize(bb, inputs[0], optional_input(inputs, 1), optional_input(inputs, 2),
                       optional_input(inputs, 3), attr)


class Upsample(OnnxOpConverter):
    """Upsample-7 (scales attribute) and -9 (scales input): Resize-10's semantics."""

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        scales = const(np.array(attr["scales"], "float32"))
        return _resize(bb, inputs[0], None, scales, None, attr, legacy=True)

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        return _resize(bb, inputs[0], None, inputs[1], None, attr, legacy=True)
