"""LayerNormalization (with its Mean/InvStdDev outputs) and RMSNormalization (any axis)."""

from __future__ import annotations

import onnx
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from ._common import (OnnxOpConverter, dtype_of, normalize_axes, optional_input, rank_of, reject,
                      scalar)

_op = relax.op


def _stash_dtype(op: str, attr: dict) -> str:
    """The dtype the statistics are computed in: `stash_type` (float32 by default)."""
    stash = onnx.helper.tensor_dtype_to_np_dtype(attr.get("stash_type", 1)).name
    if stash not in ("float32", "float64"):
        raise reject(op, f"stash_type {stash}")
    return stash


def _reduced_axis(op: str, x: relax.Expr, attr: dict) -> int:
    """`axis` as a non-negative int: the first of the normalized (trailing) axes."""
    rank = rank_of(x)
    if rank < 1:
        raise reject(op, "an input of unknown rank or rank 0")
    axis = normalize_axes([attr.get("axis", -1)], rank)[0]
    if not 0 <= axis < rank:
        raise reject(op, f"axis {attr.get('axis')} for rank {rank}")
    return axis


class LayerNormalization(OnnxOpConverter):
    """Y only: TVM's `nn.layer_norm` (fused downstream). With Mean/InvStdDev: written out as
    the ONNX reference does, statistics in `stash_type` with shape X.shape[:axis] + (1, ...)."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        if attr["tvm_custom"]["num_outputs"] == 1:
            return onnx_frontend.LayerNormalization.get_converter(17)(bb, inputs, attr, params)
        x, scale, bias = inputs[0], inputs[1], optional_input(inputs, 2)
        dtype = dtype_of(x)
        stash = _stash_dtype("LayerNormalization", attr)
        axis = _reduced_axis("LayerNormalization", x, attr)
        axes = list(range(axis, rank_of(x)))
        xs = bb.emit(_op.astype(x, stash)) if stash != dtype else x
        mean = bb.emit(_op.mean(xs, axis=axes, keepdims=True))
        diff = bb.emit(_op.subtract(xs, mean))
        variance = bb.emit(_op.mean(_op.multiply(diff, diff), axis=axes, keepdims=True))
        epsilon = scalar(attr.get("epsilon", 1e-5), stash)
        inv_std = bb.emit(_op.divide(scalar(1, stash), _op.sqrt(_op.add(variance, epsilon))))
        normed = bb.emit(_op.multiply(diff, inv_std))
        if stash != dtype:
            normed = bb.emit(_op.astype(normed, dtype))
        y = bb.emit(_op.multiply(normed, scale))
        if bias is not None:
            y = bb.emit(_op.add(y, bias))
        return relax.Tuple([y, mean, inv_std][: attr["tvm_custom"]["num_outputs"]])


class RMSNormalization(OnnxOpConverter):
    """RMS normalization over the axes from `axis` to the last, as the ONNX function body does:
    `nn.rms_norm` (unit weight) in `stash_type`, cast back, then times Scale (broadcast).

    When every axis is normalized (axis 0, where the kernel fails) the input gets a leading
    unit axis first. Refuses inputs whose shape is not known as (possibly symbolic) dims."""

    @classmethod
    def _impl_v23(cls, bb, inputs, attr, params):
        x, scale = inputs[0], inputs[1]
        dtype = dtype_of(x)
        stash = _stash_dtype("RMSNormalization", attr)
        axis = _reduced_axis("RMSNormalization", x, attr)
        dims = getattr(x.ty.shape, "values", None)
        if dims is None:
            raise reject("RMSNormalization", "an input of unknown shape")
        xs = bb.emit(_op.astype(x, stash)) if stash != dtype else x
        if axis == 0:
            xs = bb.emit(_op.expand_dims(xs, 0))
        axes = list(range(rank_of(xs) - len(dims) + axis, rank_of(xs)))
        ones = _op.ones(relax.ShapeExpr(dims[axis:]), stash)
        y = bb.emit(_op.nn.rms_norm(xs, ones, axes, attr.get("epsilon", 1e-5)))
        if axis == 0:
            y = bb.emit(_op.squeeze(y, [0]))
        if stash != dtype:
            y = bb.emit(_op.astype(y, dtype))
        return bb.emit(_op.multiply(y, scale))
