"""Col2Im and DeformConv: image <-> sliding-block (column) conversions.

Col2Im: sliding blocks (columns) summed back into an image, by a scatter-add.

Each input element (n, c * prod(block) + b, l) goes to image position
s * stride + b * dilation - pad_begin (per spatial dim, s = the block's position) of channel
c; positions outside the image go to a spare slot that is dropped. image_shape and
block_shape may be constants or run-time inputs (their length, the number of spatial dims,
must be static); the image dims are then symbolic.

DeformConv: columns sampled bilinearly (zero outside the image) at the kernel positions moved
by the offsets, weighted by the mask, then a grouped matrix product with the weights.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tvm import relax, tirx

from ._common import (OnnxOpConverter, const, const_value, dim_tensor, dtype_of,
                      optional_input, rank_of, reject, scalar, shape_from_tensor, static_shape)

_op = relax.op


def _dims(bb: relax.BlockBuilder, value: relax.Expr, prefix: str) -> list[Any]:
    """A 1-D int64 input of static length as a list of dimensions (constant or symbolic)."""
    constant = const_value(value)
    if constant is not None:
        return [tirx.IntImm("int64", int(v)) for v in constant]
    length = static_shape(value)
    if length is None:
        raise reject(prefix, "a shape input of unknown length")
    return list(shape_from_tensor(bb, value, length[0], prefix).values)


def _digits(flat: relax.Expr, sizes: list[Any]) -> list[relax.Expr]:
    """The row-major multi-index (one tensor per dim) of the flat index tensor `flat`."""
    digits = []
    for d, size in enumerate(sizes):
        stride = math.prod(sizes[d + 1:]) if d + 1 < len(sizes) else 1
        digits.append(_op.floor_mod(_op.floor_divide(flat, dim_tensor(stride)), dim_tensor(size)))
    return digits


class Col2Im(OnnxOpConverter):
    """Col2Im-18 with dilations, pads and strides, any number of spatial dims."""

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        op = cls.__name__
        x = inputs[0]
        if rank_of(x) != 3 or x.ty.shape is None:
            raise reject(op, "an input of rank other than 3")
        image = _dims(bb, inputs[1], "image")
        block = _dims(bb, inputs[2], "block")
        k = len(image)
        if len(block) != k:
            raise reject(op, "image_shape and block_shape of different lengths")
        dilations = list(attr.get("dilations", [1] * k))
        strides = list(attr.get("strides", [1] * k))
        pads = list(attr.get("pads", [0] * 2 * k))
        batch, channels_blocks, count = x.ty.shape.values
        blocks = [tirx.floordiv(image[d] + pads[d] + pads[d + k]
                                - dilations[d] * (block[d] - 1) - 1, strides[d]) + 1
                  for d in range(k)]
        block_size, image_size = math.prod(block), math.prod(image)
        channels = tirx.floordiv(channels_blocks, block_size)

        row = _op.expand_dims(_op.arange(0, channels_blocks, 1, "int64"), 1)
        col = _op.expand_dims(_op.arange(0, count, 1, "int64"), 0)
        offsets = _digits(_op.floor_mod(row, dim_tensor(block_size)), block)
        starts = _digits(col, blocks)
        target = _op.multiply(_op.floor_divide(row, dim_tensor(block_size)), dim_tensor(image_size))
        inside = None
        for d in range(k):
            pos = _op.subtract(
                _op.add(_op.multiply(starts[d], scalar(strides[d], "int64")),
                        _op.multiply(offsets[d], scalar(dilations[d], "int64"))),
                scalar(pads[d], "int64"))
            ok = _op.logical_and(_op.greater_equal(pos, scalar(0, "int64")),
                                 _op.less(pos, dim_tensor(image[d])))
            inside = ok if inside is None else _op.logical_and(inside, ok)
            stride = math.prod(image[d + 1:]) if d + 1 < k else 1
            target = _op.add(target, _op.multiply(pos, dim_tensor(stride)))
        spare = channels * image_size
        target = bb.emit(_op.where(inside, target, dim_tensor(spare)))
        flat = channels_blocks * count
        index = bb.emit(_op.broadcast_to(_op.reshape(target, [1, flat]), [batch, flat]))
        zeros = _op.zeros(relax.ShapeExpr([batch, spare + 1]), x.ty.dtype)
        summed = bb.emit(_op.scatter_elements(zeros, index, _op.reshape(x, [batch, flat]),
                                              axis=1, reduction="add"))
        image_part = _op.strided_slice(summed, [1], [0], [spare])
        return bb.emit(_op.reshape(image_part, [batch, channels] + image))


class DeformConv(OnnxOpConverter):
    """DeformConv-19/22, 2-D, with group, offset_group, dilations, pads, strides, optional bias
    and mask; every shape but the batch size must be known at import time."""

    @classmethod
    def _impl_v19(cls, bb, inputs, attr, params):
        op = cls.__name__
        x, w, offset = inputs[0], inputs[1], inputs[2]
        bias, mask = optional_input(inputs, 3), optional_input(inputs, 4)
        x_shape, w_shape, o_shape = static_shape(x), static_shape(w), static_shape(offset)
        if x_shape is None or w_shape is None or o_shape is None or len(x_shape) != 4:
            raise reject(op, "a non-2-D input or shapes unknown at import time")
        dtype = dtype_of(x)
        batch, channels, height, width = x_shape
        out_channels, _, kh, kw = w_shape
        oh, ow = o_shape[2:]
        group, offset_group = int(attr.get("group", 1)), int(attr.get("offset_group", 1))
        sh, sw = attr.get("strides", (1, 1))
        dh, dw = attr.get("dilations", (1, 1))
        pt, pl = attr.get("pads", (0, 0, 0, 0))[:2]
        taps, cells = kh * kw, oh * ow

        k = np.arange(taps)[:, None]
        cell = np.arange(cells)[None, :]
        base_y = const(((cell // ow) * sh - pt + (k // kw) * dh).astype(dtype))
        base_x = const(((cell % ow) * sw - pl + (k % kw) * dw).astype(dtype))
        moves = bb.emit(_op.reshape(offset, [batch, offset_group, taps, 2, cells]))
        y = bb.emit(_op.add(base_y, _op.take(moves, relax.const(0, "int64"), axis=3)))
        x_pos = bb.emit(_op.add(base_x, _op.take(moves, relax.const(1, "int64"), axis=3)))
        image = bb.emit(_op.reshape(x, [batch, offset_group, channels // offset_group,
                                        height * width]))
        sampled = _bilinear(bb, image, y, x_pos, height, width)  # (b, og, c/og, taps, cells)
        if mask is not None:
            sampled = bb.emit(_op.multiply(
                sampled, _op.reshape(mask, [batch, offset_group, 1, taps, cells])))
        columns = _op.reshape(sampled, [batch, group, channels // group * taps, cells])
        weights = _op.reshape(w, [group, out_channels // group, channels // group * taps])
        out = _op.reshape(_op.matmul(weights, columns), [batch, out_channels, oh, ow])
        if bias is not None:
            out = _op.add(out, _op.reshape(bias, [1, out_channels, 1, 1]))
        return bb.emit(out)


def _bilinear(bb: relax.BlockBuilder, image: relax.Expr, y: relax.Expr, x: relax.Expr,
              height: int, width: int) -> relax.Expr:
    """`image` (b, og, c, h*w) sampled at (y, x) (b, og, taps, cells) with bilinear weights,
    corners outside the image counting zero: (b, og, c, taps, cells)."""
    dtype = dtype_of(image)
    y0, x0 = bb.emit(_op.floor(y)), bb.emit(_op.floor(x))
    fy, fx = bb.emit(_op.subtract(y, y0)), bb.emit(_op.subtract(x, x0))
    one = scalar(1, dtype)
    b, og, c, _ = image.ty.shape.values
    taps, cells = y.ty.shape.values[2:]
    total = None
    for dy, wy in ((0, _op.subtract(one, fy)), (1, fy)):
        for dx, wx in ((0, _op.subtract(one, fx)), (1, fx)):
            row = _op.astype(_op.add(y0, scalar(dy, dtype)), "int64")
            col = _op.astype(_op.add(x0, scalar(dx, dtype)), "int64")
            inside = _op.logical_and(
                _op.logical_and(_op.greater_equal(row, scalar(0, "int64")),
                                _op.less(row, scalar(height, "int64"))),
                _op.logical_and(_op.greater_equal(col, scalar(0, "int64")),
                                _op.less(col, scalar(width, "int64"))))
            weight = bb.emit(_op.where(inside, _op.multiply(wy, wx), scalar(0, dtype)))
            flat = _op.add(_op.multiply(_op.clip(row, 0, height - 1), scalar(width, "int64")),
                           _op.clip(col, 0, width - 1))
            index = _op.broadcast_to(_op.reshape(flat, [b, og, 1, taps * cells]),
                                     [b, og, c, taps * cells])
            values = _op.reshape(_op.gather_elements(image, index, axis=3),
                                 [b, og, c, taps, cells])
            term = _op.multiply(values, _op.expand_dims(weight, 2))
            total = bb.emit(term if total is None else _op.add(total, term))
    return total
