"""DFT and STFT as matrix products with cos/sin matrices built in the graph; MelWeightMatrix.

The matrices come from `arange` over the transform's lengths, so the lengths (dft_length,
STFT's frame_step and frame_length) may be constants or run-time inputs; a length known only
at run time gives a symbolic output dimension. Angles are reduced mod n in integers before the
float conversion, so large indices lose no precision. Computed in float32 (float64 for double
inputs) and cast back.

DFT: forward/inverse, onesided (rfft; with inverse, irfft: Hermitian input, real output),
dft_length (truncating or zero-padding), axis as attribute (opset 17) or input (opset 20).
A run-time axis is handled by computing the transform along every candidate axis and selecting
the requested one; where the candidates' shapes differ (onesided), each is zero-padded to a
common shape and the selected one is cut back to its shape at run time (static shapes only).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import tvm
import tvm_ffi
from tvm import relax, tirx

from ._common import (OnnxOpConverter, const, const_value, dim_tensor, dtype_of,
                      optional_input, rank_of, reject, scalar, scalar_dim, shape_from_tensor,
                      static_shape)

_op = relax.op
PrimExpr = Any  # a TIR integer expression (IntImm or symbolic)


def _twiddles(bb: relax.BlockBuilder, rows: PrimExpr, cols: PrimExpr, n: PrimExpr,
              used_rows: PrimExpr, dtype: str) -> tuple[relax.Expr, relax.Expr]:
    """cos and sin of 2 pi j k / n for j < rows, k < cols, as (rows, cols) matrices of
    `dtype` whose rows j >= used_rows are zero."""
    j = _op.expand_dims(_op.arange(0, rows, 1, "int64"), 1)
    k = _op.expand_dims(_op.arange(0, cols, 1, "int64"), 0)
    n_t = dim_tensor(n)
    step = _op.divide(scalar(2 * np.pi, dtype), _op.astype(n_t, dtype))
    theta = bb.emit(_op.multiply(_op.astype(_op.floor_mod(_op.multiply(j, k), n_t), dtype), step))
    inside = _op.less(j, dim_tensor(used_rows))
    zero = scalar(0, dtype)
    return (bb.emit(_op.where(inside, _op.cos(theta), zero)),
            bb.emit(_op.where(inside, _op.sin(theta), zero)))


def dft(bb: relax.BlockBuilder, x: relax.Expr, axis: int, n: PrimExpr | None, inverse: bool,
        onesided: bool) -> relax.Expr:
    """ONNX DFT of `x` (..., 1 or 2 for real / complex) along `axis` (not the last)."""
    rank = rank_of(x)
    dtype = dtype_of(x)
    work = "float64"
    shape = x.ty.shape.values
    length, parts = shape[axis], int(shape[-1])
    others = [i for i in range(rank - 1) if i != axis]
    moved = bb.emit(_op.astype(_op.permute_dims(x, others + [rank - 1, axis]), work))
    re = bb.emit(_op.take(moved, relax.const(0, "int64"), axis=rank - 2))
    im = bb.emit(_op.take(moved, relax.const(1, "int64"), axis=rank - 2)) if parts == 2 else None

    if inverse and onesided:  # irfft: bins k < n // 2 + 1, each but 0 and n / 2 counted twice
        n = n if n is not None else 2 * (length - 1)
        cos, sin = _twiddles(bb, length, n, n, n // 2 + 1, work)
        k = _op.expand_dims(_op.arange(0, length, 1, "int64"), 1)
        single = _op.logical_or(_op.equal(k, relax.const(0, "int64")),
                                _op.equal(_op.multiply(k, relax.const(2, "int64")), dim_tensor(n)))
        weight = bb.emit(_op.where(single, scalar(1, work), scalar(2, work)))
        real = _op.matmul(re, _op.multiply(weight, cos))
        if im is not None:
            real = _op.subtract(real, _op.matmul(im, _op.multiply(weight, sin)))
        outputs = [real]
    else:
        n = n if n is not None else length
        cos, sin = _twiddles(bb, length, n // 2 + 1 if onesided else n, n, n, work)
        sign = 1 if inverse else -1
        real, imag = _op.matmul(re, cos), _op.multiply(scalar(sign, work), _op.matmul(re, sin))
        if im is not None:
            real = _op.subtract(real, _op.multiply(scalar(sign, work), _op.matmul(im, sin)))
            imag = _op.add(imag, _op.matmul(im, cos))
        outputs = [real, imag]
    if inverse:
        scale = _op.astype(dim_tensor(n), work)
        outputs = [_op.divide(o, scale) for o in outputs]
    result = bb.emit(_op.stack(outputs, axis=-1))  # others..., transformed axis, 1 or 2
    back = [others.index(p) if p in others else (rank - 2 if p == axis else rank - 1)
            for p in range(rank)]
    return bb.emit(_op.astype(_op.permute_dims(result, back), dtype))


class DFT(OnnxOpConverter):
    """DFT-17 (axis attribute) and DFT-20 (axis input, constant or run-time)."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        return cls._convert(bb, inputs[0], optional_input(inputs, 1), int(attr.get("axis", 1)),
                            attr)

    @classmethod
    def _impl_v20(cls, bb, inputs, attr, params):
        axis = optional_input(inputs, 2)
        value = -2 if axis is None else const_value(axis)
        return cls._convert(bb, inputs[0], optional_input(inputs, 1),
                            axis if value is None else int(value), attr)

    @classmethod
    def _convert(cls, bb, x, dft_length, axis, attr):
        op = cls.__name__
        rank = rank_of(x)
        shape = x.ty.shape
        if shape is None or not isinstance(shape.values[-1], tvm.tirx.IntImm) \
                or int(shape.values[-1]) not in (1, 2):
            raise reject(op, "a last dimension other than 1 or 2 (or unknown)")
        n = scalar_dim(bb, dft_length, "dft_length")
        inverse, onesided = bool(attr.get("inverse", 0)), bool(attr.get("onesided", 0))
        if isinstance(axis, int):
            axis = axis + rank if axis < 0 else axis
            if not 0 <= axis < rank - 1:
                raise reject(op, f"axis={axis}")
            return dft(bb, x, axis, n, inverse, onesided)
        candidates = {a: dft(bb, x, a, n, inverse, onesided) for a in range(rank - 1)}
        shapes = [c.ty.shape for c in candidates.values()]
        if all(tvm_ffi.structural_equal(s, shapes[0]) for s in shapes):
            return _select(bb, axis, rank, candidates)
        return _select_padded(bb, op, axis, rank, candidates)


def _chosen(axis: relax.Expr, a: int, rank: int) -> relax.Expr:
    """Whether the run-time `axis` names axis `a` (counted from either end)."""
    return _op.logical_or(_op.equal(axis, relax.const(a, "int64")),
                          _op.equal(axis, relax.const(a - rank, "int64")))


def _select(bb: relax.BlockBuilder, axis: relax.Expr, rank: int,
            candidates: dict[int, relax.Expr]) -> relax.Expr:
    """The candidate for the run-time `axis` (any other value gives the last candidate)."""
    axis = bb.emit(_op.astype(axis, "int64"))
    last = max(candidates)
    result = candidates[last]
    for a, value in candidates.items():
        if a != last:
            result = bb.emit(_op.where(_chosen(axis, a, rank), value, result))
    return result


def _select_padded(bb: relax.BlockBuilder, op: str, axis: relax.Expr, rank: int,
                   candidates: dict[int, relax.Expr]) -> relax.Expr:
    """As `_select` for candidates of different static shapes: each is zero-padded to their
    common bounding shape, and the selected one is cut back to its own shape at run time."""
    shapes = [static_shape(c) for c in candidates.values()]
    if any(s is None for s in shapes):
        raise reject(op, "a run-time axis with output shapes unknown at import time")
    bound = np.max(np.array(shapes), axis=0)
    padded = {a: bb.emit(_op.nn.pad(c, [w for d, s in zip(bound, static_shape(c))
                                         for w in (0, int(d - s))]))
              for a, c in candidates.items()}
    sizes = {a: const(np.array(static_shape(c), "int64")) for a, c in candidates.items()}
    dims = shape_from_tensor(bb, _select(bb, axis, rank, sizes), len(bound), "dft").values
    result = _select(bb, axis, rank, padded)
    for d in np.flatnonzero(np.ptp(np.array(shapes), axis=0)):
        result = bb.emit(_op.take(result, _op.arange(0, dims[d], 1, "int64"), axis=int(d)))
    return result


class STFT(OnnxOpConverter):
    """STFT-17 of a (batch, length, 1 or 2) signal: frames of frame_length (or the window's
    length) every frame_step samples (either may be a run-time input), times the window,
    then a DFT per frame (onesided by default)."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        op = cls.__name__
        signal, window = inputs[0], optional_input(inputs, 2)
        if signal.ty.shape is None or rank_of(signal) != 3:
            raise reject(op, "a signal of rank other than 3")
        length = signal.ty.shape.values[1]
        step = scalar_dim(bb, inputs[1], "frame_step")
        frame = scalar_dim(bb, optional_input(inputs, 3), "frame_length")
        if frame is None:
            frame = window.ty.shape.values[0] if window is not None else length
        frames = 1 + tirx.floordiv(length - frame, step)
        starts = _op.multiply(_op.expand_dims(_op.arange(0, frames, 1, "int64"), 1),
                              dim_tensor(step))
        index = bb.emit(_op.add(starts, _op.expand_dims(_op.arange(0, frame, 1, "int64"), 0)))
        framed = bb.emit(_op.take(signal, index, axis=1))  # (batch, frames, frame, 1 or 2)
        if window is not None:
            framed = bb.emit(_op.multiply(framed, _op.reshape(window, [frame, 1])))
        return dft(bb, framed, 2, frame, False, bool(attr.get("onesided", 1)))


class MelWeightMatrix(OnnxOpConverter):
    """MelWeightMatrix-17: (dft_length // 2 + 1, num_mel_bins) triangular filters, as ONNX's
    reference builds them (mel points spaced by range / (num_mel_bins + 2), floored to bins).
    The integer inputs may be run-time values (symbolic output dims)."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        mels = scalar_dim(bb, inputs[0], "num_mel_bins")
        length = scalar_dim(bb, inputs[1], "dft_length")
        wide = [bb.emit(_op.astype(_op.reshape(x, [1]), "float64")) for x in inputs]
        mels_f, length_f, rate, low, high = wide
        one = scalar(1, "float64")

        def to_mel(hertz):
            return _op.multiply(scalar(2595 / np.log(10), "float64"),
                                _op.log(_op.add(one, _op.divide(hertz, scalar(700, "float64")))))

        low_mel = bb.emit(to_mel(low))
        step = _op.divide(_op.subtract(to_mel(high), low_mel),
                          _op.add(mels_f, scalar(2, "float64")))
        count = _op.astype(_op.arange(0, mels + 2, 1, "int64"), "float64")
        points = _op.add(_op.multiply(count, step), low_mel)
        hertz = _op.multiply(scalar(700, "float64"), _op.subtract(
            _op.exp(_op.multiply(points, scalar(np.log(10) / 2595, "float64"))), one))
        scaled = _op.divide(_op.multiply(_op.add(length_f, one), hertz), rate)
        bins = bb.emit(_op.astype(_op.floor(scaled), "int64"))  # (num_mel_bins + 2,)
        first = bb.emit(_op.arange(0, mels, 1, "int64"))
        left, center, right = (
            bb.emit(_op.expand_dims(_op.take(bins, _op.add(first, relax.const(o, "int64"))), 0))
            for o in range(3))
        j = bb.emit(_op.expand_dims(_op.arange(0, length // 2 + 1, 1, "int64"), 1))
        zero = scalar(0, "float64")

        def ramp(num, den):
            return _op.divide(_op.astype(num, "float64"),
                              _op.astype(_op.maximum(den, relax.const(1, "int64")), "float64"))

        rising = _op.logical_and(_op.greater_equal(j, left), _op.less_equal(j, center))
        weights = _op.where(_op.logical_and(_op.greater(center, left), rising),
                            ramp(_op.subtract(j, left), _op.subtract(center, left)), zero)
        weights = _op.where(_op.logical_and(_op.equal(center, left), _op.equal(j, center)),
                            one, weights)
        falling = _op.logical_and(_op.greater_equal(j, center), _op.less(j, right))
        weights = _op.where(_op.logical_and(_op.greater(right, center), falling),
                            ramp(_op.subtract(right, j), _op.subtract(right, center)), weights)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(attr.get("output_datatype", 1)).name
        return bb.emit(_op.astype(weights, dtype))
