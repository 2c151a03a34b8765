"""Kernels on channel-blocked NCHW{B}c data (`gimlet.cpu.conv2d_nchw_direct` with 5-D data
and output, `gimlet.cpu.conv2d_nchwc_depthwise`) against numpy, and the blocked-layout pass
(`relax_passes.blocked_layout`) on whole models against onnxruntime, with its layout
transforms of activations only at the edges of the blocked regions.

8-channel blocks run the AVX2 instances, 16-channel blocks the AVX-512 ones (or the AVX2 ones
on 16-lane vectors on a CPU without AVX-512).
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime
import pytest
import tvm
from onnx import helper

import gimlet_tvm
from gimlet_tvm import models
from gimlet_tvm.compiler import graph_passes, kernel_passes, resolve_target
from gimlet_tvm.errors import CompileError
from gimlet_tvm.frontend import import_model
from gimlet_tvm.relax_passes.blocked_layout import (
    BLOCKED_LAYOUT_ENV, FROM_BLOCKED_FUNC, SPATIAL_MEAN_FUNC, TO_BLOCKED_FUNC)
from gimlet_tvm.relax_passes.concat_in_place import CONCAT_FUNC
from gimlet_tvm.relax_passes.dispatch_cpu_library import (
    ADD_BLOCKED_VECTOR, ADD_TENSOR, BLOCKED_CONV2D_FUNC, BLOCKED_DEPTHWISE_CONV2D_FUNC, BLOCKED_MAX_POOL_FUNC,
    CONV_ALGORITHMS, DIRECT_CONV2D_FUNC, HARD_SWISH, IM2COL_CONV2D_FUNC, RELU, SCALED_DIRECT_CONV2D_FUNC, SIGMOID,
    SILU, WINOGRAD_CONV2D_FUNC, WINOGRAD_ENV, direct_conv_block, pack_conv_weight)
from gimlet_tvm.relax_passes.library_dispatch import layout_passes, library_passes
from gimlet_tvm.runtime.extensions import load_extensions
from gimlet_tvm.schedules.kernel_selection.candidates import OpSignature
from gimlet_tvm.schedules.kernel_selection.choices import KernelSelection, OpChoice, Tried
from gimlet_tvm.schedules.kernel_selection.op_kinds import OP_KINDS
from gimlet_tvm.schedules.kernel_selection.sources import candidates
from gimlet_tvm.schedules.tuning.records import target_key
from gimlet_tvm.selection.select import op_signatures, select_kernels
from gimlet_tvm.targets import host_spec

from .test_cpu_direct_conv import clip_step, reference_conv
from .test_cpu_library import onnx_model, rand

BLOCKS = [8, 16]


def to_blocked(x: np.ndarray, block: int) -> np.ndarray:
    """NCHW as NCHW{block}c, channels past a multiple of block 0."""
    n, c, h, w = x.shape
    blocks = -(-c // block)
    x = np.concatenate([x, np.zeros((n, blocks * block - c, h, w), x.dtype)], axis=1)
    return np.ascontiguousarray(x.reshape(n, blocks, block, h, w).transpose(0, 1, 3, 4, 2))


def from_blocked(x: np.ndarray) -> np.ndarray:
    n, cb, h, w, b = x.shape
    return x.transpose(0, 1, 4, 2, 3).reshape(n, cb * b, h, w)


def out_size(size, kernel, stride, pads, dilation):
    return tuple((s + 2 * p - d * (k - 1) - 1) // st + 1
                 for s, k, st, p, d in zip(size, kernel, stride, pads, dilation))


# 16-channel blocks run both tile policies of the AVX-512 kernel, whatever this CPU's
# (`$GIMLET_CPU_CONV_TILES`, TwoBlockRowTiles in the library: four-block tiles and grid tiles as
# on Intel, two-block row tiles as on AMD).
BLOCK_TILES = [(8, None), (16, "grid"), (16, "rows")]


@pytest.mark.parametrize("block, tiles", BLOCK_TILES)
@pytest.mark.parametrize("blocked_in", [True, False])
@pytest.mark.parametrize(
    "batch, in_c, size, out_c, kernel, stride, pads, dilation",
    [
        (2, 32, (7, 9), 48, (1, 1), (1, 1), (0, 0), (1, 1)),  # 1x1: a GEMM, odd plane
        (1, 16, (9, 11), 32, (1, 1), (2, 2), (0, 0), (1, 1)),  # 1x1 stride 2
        (2, 16, (13, 11), 16, (3, 3), (1, 1), (1, 1), (1, 1)),  # one output block
        (1, 32, (15, 14), 64, (3, 3), (2, 2), (1, 1), (1, 1)),  # stride 2
        (1, 16, (12, 10), 32, (3, 3), (1, 1), (2, 2), (2, 2)),  # dilated
        # AVX-512's row tiles (7x7 and 16x16 planes, where grid tiles waste over 5%; 14 wide on
        # planes up to 28 wide that 14 divides)
        (2, 32, (7, 7), 48, (1, 1), (1, 1), (0, 0), (1, 1)),  # 1x1, odd last block
        (2, 32, (14, 14), 48, (3, 3), (1, 1), (1, 1), (1, 1)),  # 14 wide, odd last block
        (1, 16, (28, 28), 128, (1, 1), (1, 1), (0, 0), (1, 1)),  # 14 wide, not four-block grid tiles
        (1, 16, (14, 14), 64, (1, 1), (1, 1), (0, 0), (1, 1)),  # one four-block group: grid tiles
        (2, 16, (9, 32), 16, (3, 3), (1, 1), (1, 1), (1, 1)),  # one block: row tiles of 16
        (1, 16, (20, 64), 16, (3, 3), (2, 2), (1, 1), (1, 1)),  # ... stride 2
        (1, 16, (28, 28), 32, (3, 3), (2, 2), (1, 1), (1, 1)),  # 14 wide, stride 2
        (1, 32, (16, 16), 32, (3, 3), (1, 1), (1, 1), (1, 1)),  # 8 wide
        (1, 16, (14, 14), 32, (3, 3), (2, 2), (1, 1), (1, 1)),  # 7 wide, stride 2
        # two-block row tiles past 28 wide ("rows": 14 wide at 56, 8 wide at 32)
        (1, 32, (56, 56), 64, (1, 1), (1, 1), (0, 0), (1, 1)),
        (1, 16, (64, 64), 32, (3, 3), (2, 2), (1, 1), (1, 1)),
        # each thread copies the input rows its own tiles read: an image's rows split between
        # threads, groups of blocks split between them (each reads every row), images and groups
        (3, 16, (48, 40), 16, (3, 3), (1, 1), (1, 1), (1, 1)),
        (1, 64, (28, 28), 128, (3, 3), (1, 1), (1, 1), (1, 1)),
        (2, 32, (30, 30), 96, (3, 3), (2, 2), (1, 1), (1, 1)),
        # a padded copy with over 512 KiB of weights (rows split, each chunk through all
        # groups) and over 1 MiB (group by group, each thread copying every row)
        (1, 128, (14, 14), 128, (3, 3), (2, 2), (1, 1), (1, 1)),
        (1, 128, (12, 12), 256, (3, 3), (1, 1), (1, 1), (1, 1)),
        (2, 32, (11, 13), 64, (1, 1), (1, 1), (0, 0), (1, 1)),  # AVX-512: 4-block tiles
        (1, 48, (9, 10), 128, (3, 3), (2, 2), (1, 1), (1, 1)),  # ... stride 2
    ],
)
def test_blocked_direct_conv2d_against_numpy(block, tiles, blocked_in, batch, in_c, size, out_c,
                                             kernel, stride, pads, dilation, monkeypatch) -> None:
    load_extensions()
    if tiles is not None:
        monkeypatch.setenv("GIMLET_CPU_CONV_TILES", tiles)
    oh, ow = out_size(size, kernel, stride, pads, dilation)
    x, weight = rand(batch, in_c, *size, seed=1), rand(out_c, in_c, *kernel, seed=2)
    bias = rand(out_c, seed=3)
    residual = rand(batch, out_c, oh, ow, seed=4)
    y = tvm.runtime.tensor(np.full((batch, out_c // block, oh, ow, block), np.nan, np.float32))
    data = to_blocked(x, block) if blocked_in else x
    tvm.get_global_func(DIRECT_CONV2D_FUNC)(
        tvm.runtime.tensor(data), tvm.runtime.tensor(pack_conv_weight(weight, block)),
        *stride, *pads, *dilation,
        ADD_BLOCKED_VECTOR, tvm.runtime.tensor(bias), oh * ow * block, block,
        ADD_TENSOR, tvm.runtime.tensor(to_blocked(residual, block)), *clip_step(0.0, 6.0), y)
    expected = reference_conv(x, weight, stride, pads, dilation, (oh, ow))
    expected = np.clip(expected + bias[:, None, None] + residual, 0.0, 6.0)
    np.testing.assert_allclose(from_blocked(y.numpy()), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize(
    "batch, groups, group_c, size, out_group_c, kernel, stride",
    [
        (1, 4, 1, (9, 9), 1, (3, 3), (1, 1)),  # ResNeXt's stage 3: groups of one block
        (2, 4, 2, (10, 11), 1, (3, 3), (2, 2)),  # two blocks in, one out, stride 2, two images
        (1, 2, 2, (7, 7), 2, (3, 3), (1, 1)),  # stage 4: groups of two blocks, 7x7 row tiles
        (3, 3, 1, (6, 5), 1, (1, 1), (1, 1)),  # 1x1 (pointwise: the data read as it is)
    ],
)
def test_grouped_direct_conv2d_against_numpy(block, batch, groups, group_c, size, out_group_c, kernel,
                                             stride) -> None:
    """Groups of whole channel blocks on blocked data and output: each group of each image runs
    as an image of its own, its weights and bias those of its group's blocks, the residual
    its own."""
    load_extensions()
    in_c, out_c = groups * group_c * block, groups * out_group_c * block
    pads = tuple(k // 2 for k in kernel)
    oh, ow = out_size(size, kernel, stride, pads, (1, 1))
    x, weight = rand(batch, in_c, *size, seed=1), rand(out_c, in_c // groups, *kernel, seed=2)
    bias, residual = rand(out_c, seed=3), rand(batch, out_c, oh, ow, seed=4)
    y = tvm.runtime.tensor(np.full((batch, out_c // block, oh, ow, block), np.nan, np.float32))
    tvm.get_global_func(DIRECT_CONV2D_FUNC)(
        tvm.runtime.tensor(to_blocked(x, block)), tvm.runtime.tensor(pack_conv_weight(weight, block)),
        *stride, *pads, 1, 1, ADD_BLOCKED_VECTOR, tvm.runtime.tensor(bias), oh * ow * block, block,
        ADD_TENSOR, tvm.runtime.tensor(to_blocked(residual, block)), RELU, y)
    per, per_out = in_c // groups, out_c // groups
    expected = np.concatenate([
        reference_conv(x[:, g * per:(g + 1) * per], weight[g * per_out:(g + 1) * per_out], stride, pads, (1, 1), (oh, ow))
        for g in range(groups)], axis=1)
    expected = np.maximum(expected + bias[:, None, None] + residual, 0.0)
    np.testing.assert_allclose(from_blocked(y.numpy()), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("blocked_in", [True, False])
@pytest.mark.parametrize(
    "batch, in_c, size, out_c, kernel, stride, pads",
    [
        (1, 32, (9, 9), 16, (1, 1), (1, 1), (0, 0)),  # a squeeze-and-excitation projection
        (2, 16, (11, 10), 48, (1, 1), (1, 1), (0, 0)),  # two images, one scale
        (1, 32, (15, 13), 32, (3, 3), (2, 2), (1, 1)),  # padding stays zero under the scale
    ],
)
def test_scaled_direct_conv2d_against_numpy(block, blocked_in, batch, in_c, size, out_c, kernel, stride,
                                            pads) -> None:
    """conv(x * scale) for one factor per input channel, shared by every image, with a bias
    and ReLU: the kernel scales the weight's input channels instead of the data."""
    load_extensions()
    oh, ow = out_size(size, kernel, stride, pads, (1, 1))
    x, weight = rand(batch, in_c, *size, seed=1), rand(out_c, in_c, *kernel, seed=2)
    scale, bias = rand(in_c, seed=3), rand(out_c, seed=4)
    y = tvm.runtime.tensor(np.full((batch, out_c // block, oh, ow, block), np.nan, np.float32))
    scale_tensor = to_blocked(scale.reshape(1, in_c, 1, 1), block) if blocked_in else scale.reshape(1, in_c, 1, 1)
    tvm.get_global_func(SCALED_DIRECT_CONV2D_FUNC)(
        tvm.runtime.tensor(to_blocked(x, block) if blocked_in else x), tvm.runtime.tensor(scale_tensor),
        tvm.runtime.tensor(pack_conv_weight(weight, block)), *stride, *pads, 1, 1,
        ADD_BLOCKED_VECTOR, tvm.runtime.tensor(bias), oh * ow * block, block, RELU, y)
    expected = reference_conv(x * scale[:, None, None], weight, stride, pads, (1, 1), (oh, ow))
    expected = np.maximum(expected + bias[:, None, None], 0.0)
    np.testing.assert_allclose(from_blocked(y.numpy()), expected, rtol=1e-4, atol=1e-4)


def test_scaled_direct_conv2d_needs_one_factor_per_channel() -> None:
    """A scale per image (or of another size) is an error, not a wrong result."""
    load_extensions()
    x = tvm.runtime.tensor(to_blocked(rand(2, 16, 5, 5, seed=1), 8))
    weight = tvm.runtime.tensor(pack_conv_weight(rand(16, 16, 1, 1, seed=2), 8))
    scale = tvm.runtime.tensor(to_blocked(rand(2, 16, 1, 1, seed=3), 8))
    y = tvm.runtime.tensor(np.zeros((2, 2, 5, 5, 8), np.float32))
    with pytest.raises(Exception, match="one factor per input channel"):
        tvm.get_global_func(SCALED_DIRECT_CONV2D_FUNC)(x, scale, weight, 1, 1, 0, 0, 1, 1, y)


def test_grouped_direct_conv2d_needs_whole_blocks() -> None:
    """Groups that split a channel block (or NCHW data) are an error, not a wrong result."""
    load_extensions()
    x = tvm.runtime.tensor(to_blocked(rand(1, 16, 5, 5, seed=1), 8))
    weight = tvm.runtime.tensor(pack_conv_weight(rand(16, 4, 3, 3, seed=2), 8))  # 4 groups of 4
    y = tvm.runtime.tensor(np.zeros((1, 2, 5, 5, 8), np.float32))
    with pytest.raises(Exception, match="groups need blocked data and output whose groups fill whole"):
        tvm.get_global_func(DIRECT_CONV2D_FUNC)(x, weight, 1, 1, 1, 1, 1, 1, y)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize(
    "batch, channels, size, kernel, stride, pads, dilation",
    [
        (2, 32, (9, 13), (3, 3), (1, 1), (1, 1), (1, 1)),
        (1, 16, (15, 17), (3, 3), (2, 2), (1, 1), (1, 1)),  # stride 2, odd sizes
        (1, 48, (8, 8), (3, 3), (2, 2), (0, 0), (1, 1)),  # no padding
        (1, 16, (11, 12), (3, 3), (1, 1), (2, 2), (2, 2)),  # dilated
        (1, 32, (10, 10), (5, 5), (1, 2), (2, 2), (1, 1)),  # 5x5, uneven strides
        # 3x3 with stride-1 / stride-2 / other columns (the kernel's column-stride variants)
        (1, 16, (12, 14), (3, 3), (2, 1), (1, 1), (1, 1)),
        (1, 16, (13, 13), (3, 3), (1, 3), (1, 1), (1, 1)),
        (1, 16, (12, 12), (3, 3), (1, 2), (2, 1), (2, 1)),  # rows dilated, columns not
        # one image on two threads, large planes: one band of rows per thread through all
        # blocks (41 rows: bands of 21 and 20; a thread's share ends inside the first band)
        (1, 48, (41, 30), (3, 3), (1, 1), (1, 1), (1, 1)),
        (1, 48, (81, 60), (3, 3), (2, 2), (1, 1), (1, 1)),
        # two images, 5 wide rows: banded only on more threads than images (4 threads: 3 bands
        # of 2, 2 and 1 rows; TVM's pool here has the machine's 2 cores, so not in this run)
        (2, 16, (5, 600), (3, 3), (1, 1), (1, 1), (1, 1)),
        # rows of 7 and 8 pixels: the inner columns in tiles of 4, 2 and 1 pixels
        (1, 16, (7, 7), (3, 3), (1, 1), (1, 1), (1, 1)),
        (2, 32, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1)),
        (1, 16, (9, 9), (5, 5), (1, 1), (2, 2), (1, 1)),
    ],
)
def test_blocked_depthwise_against_numpy(block, batch, channels, size, kernel, stride, pads,
                                         dilation) -> None:
    load_extensions()
    oh, ow = out_size(size, kernel, stride, pads, dilation)
    x, weight = rand(batch, channels, *size, seed=1), rand(channels, 1, *kernel, seed=2)
    bias = rand(channels, seed=3)
    packed = np.ascontiguousarray(weight.reshape(channels // block, block, 1, *kernel).transpose(0, 2, 3, 4, 1))
    y = tvm.runtime.tensor(np.full((batch, channels // block, oh, ow, block), np.nan, np.float32))
    tvm.get_global_func(BLOCKED_DEPTHWISE_CONV2D_FUNC)(
        tvm.runtime.tensor(to_blocked(x, block)), tvm.runtime.tensor(packed), *stride, *pads,
        *dilation, ADD_BLOCKED_VECTOR, tvm.runtime.tensor(bias), oh * ow * block, block, RELU, y)
    expected = np.zeros((batch, channels, oh, ow))
    for c in range(channels):
        expected[:, c:c + 1] = reference_conv(x[:, c:c + 1], weight[c:c + 1], stride, pads, dilation, (oh, ow))[:, :1]
    expected = np.maximum(expected + bias[:, None, None], 0.0)
    np.testing.assert_allclose(from_blocked(y.numpy()), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("form", ["residual_bias_clip", "clip", "bias_bias_relu", "bias_relu_bias", "relu_clip"])
def test_blocked_depthwise_epilogue_forms(block, form) -> None:
    """Epilogues of the form clip(v + bias + residual) (in one piece on the tile's vectors) and
    others (step by step: two biases, an add after the ReLU, a clip after it) against numpy, on a
    plane with tiles and bounds-checked border pixels."""
    load_extensions()
    channels, size = 2 * block, (9, 21)
    x, weight = rand(1, channels, *size, seed=1), rand(channels, 1, 3, 3, seed=2)
    bias, residual = rand(channels, seed=3), rand(1, channels, *size, seed=4)
    packed = np.ascontiguousarray(weight.reshape(channels // block, block, 1, 3, 3).transpose(0, 2, 3, 4, 1))
    add_bias = (ADD_BLOCKED_VECTOR, tvm.runtime.tensor(bias), size[0] * size[1] * block, block)
    conv = np.concatenate([reference_conv(x[:, c:c + 1], weight[c:c + 1], (1, 1), (1, 1), (1, 1), size)[:, :1]
                           for c in range(channels)], axis=1)
    b = bias[:, None, None]
    steps, expected = {
        "residual_bias_clip": ((ADD_TENSOR, tvm.runtime.tensor(to_blocked(residual, block)), *add_bias, *clip_step(0.0, 6.0)),
                               np.clip(conv + residual + b, 0.0, 6.0)),
        "clip": (clip_step(-0.5, 0.5), np.clip(conv, -0.5, 0.5)),
        "bias_bias_relu": ((*add_bias, *add_bias, RELU), np.maximum(conv + 2 * b, 0.0)),
        "bias_relu_bias": ((*add_bias, RELU, *add_bias), np.maximum(conv + b, 0.0) + b),
        "relu_clip": ((RELU, *clip_step(-1.0, 0.25)), np.clip(np.maximum(conv, 0.0), -1.0, 0.25)),
    }[form]
    y = tvm.runtime.tensor(np.full((1, channels // block, *size, block), np.nan, np.float32))
    tvm.get_global_func(BLOCKED_DEPTHWISE_CONV2D_FUNC)(
        tvm.runtime.tensor(to_blocked(x, block)), tvm.runtime.tensor(packed), 1, 1, 1, 1, 1, 1, *steps, y)
    np.testing.assert_allclose(from_blocked(y.numpy()), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("depthwise", [False, True])
@pytest.mark.parametrize("activation", ["relu", "clip"])
def test_blocked_conv_epilogues_keep_nan(block, depthwise, activation) -> None:
    """A NaN in the data stays NaN through the register tiles' bias, ReLU and clip (as in numpy
    and onnxruntime), in the direct and the depthwise kernel: a clamp written with its operands
    the other way round (`v > lo ? v : lo`) turns it into the bound."""
    load_extensions()
    channels, size = 2 * block, (9, 16)
    x = rand(1, channels, *size, seed=1)
    x[0, 3, 4, 5] = np.nan
    bias = rand(channels, seed=3)
    if depthwise:
        weight = rand(channels, 1, 3, 3, seed=2)
        packed = np.ascontiguousarray(weight.reshape(channels // block, block, 1, 3, 3).transpose(0, 2, 3, 4, 1))
        conv = np.concatenate([reference_conv(x[:, c:c + 1], weight[c:c + 1], (1, 1), (1, 1), (1, 1), size)[:, :1]
                               for c in range(channels)], axis=1)
        func = BLOCKED_DEPTHWISE_CONV2D_FUNC
    else:
        weight = rand(channels, channels, 3, 3, seed=2)
        packed, conv = pack_conv_weight(weight, block), reference_conv(x, weight, (1, 1), (1, 1), (1, 1), size)
        func = DIRECT_CONV2D_FUNC
    add_bias = (ADD_BLOCKED_VECTOR, tvm.runtime.tensor(bias), size[0] * size[1] * block, block)
    steps, expected = {
        "relu": ((*add_bias, RELU), np.maximum(conv + bias[:, None, None], 0.0)),
        "clip": ((*add_bias, *clip_step(0.0, 6.0)), np.clip(conv + bias[:, None, None], 0.0, 6.0)),
    }[activation]
    assert np.isnan(expected).sum() == (9 if depthwise else 9 * channels)
    y = tvm.runtime.tensor(np.zeros((1, channels // block, *size, block), np.float32))
    tvm.get_global_func(func)(tvm.runtime.tensor(to_blocked(x, block)), tvm.runtime.tensor(packed),
                              1, 1, 1, 1, 1, 1, *steps, y)
    np.testing.assert_allclose(from_blocked(y.numpy()), expected, rtol=1e-4, atol=1e-4)


def reference_max_pool(x: np.ndarray, kernel, stride, pads, dilation, out_hw) -> np.ndarray:
    """Max pooling of NCHW `x` over each window's pixels inside the input (numpy)."""
    n, c, h, w = x.shape
    out = np.empty((n, c, *out_hw), np.float32)
    for oy in range(out_hw[0]):
        for ox in range(out_hw[1]):
            window = [x[:, :, iy, ix]
                      for iy in range(oy * stride[0] - pads[0], oy * stride[0] - pads[0] + kernel[0] * dilation[0], dilation[0])
                      for ix in range(ox * stride[1] - pads[1], ox * stride[1] - pads[1] + kernel[1] * dilation[1], dilation[1])
                      if 0 <= iy < h and 0 <= ix < w]
            out[:, :, oy, ox] = np.max(window, axis=0)  # NaN where any is
    return out


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize(
    "batch, channels, size, kernel, stride, pads, dilation, out_hw",
    [
        (1, 64, (111, 111), (3, 3), (2, 2), (0, 0), (1, 1), (55, 55)),  # SqueezeNet's
        (2, 32, (112, 112), (3, 3), (2, 2), (1, 1), (1, 1), (56, 56)),  # ResNet's, two images
        (1, 16, (13, 13), (3, 3), (2, 2), (0, 0), (1, 1), (6, 6)),  # ceil mode: a window past the edge
        (1, 32, (9, 10), (2, 3), (1, 2), (1, 1), (2, 1), (8, 5)),  # uneven, dilated rows
    ],
)
def test_blocked_max_pool_against_numpy(block, batch, channels, size, kernel, stride, pads, dilation,
                                        out_hw) -> None:
    """Max pooling on blocked data: padding never wins, windows past the input (ceil mode) are
    cut at its edge, NaN propagates."""
    load_extensions()
    x = rand(batch, channels, *size, seed=1)
    x[0, 3, 4, 5] = np.nan
    y = tvm.runtime.tensor(np.full((batch, channels // block, *out_hw, block), 7.0, np.float32))
    tvm.get_global_func(BLOCKED_MAX_POOL_FUNC)(tvm.runtime.tensor(to_blocked(x, block)), *stride, *pads,
                                               *dilation, *kernel, y)
    np.testing.assert_array_equal(from_blocked(y.numpy()), reference_max_pool(x, kernel, stride, pads, dilation, out_hw))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x.astype(np.float64)))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def hard_swish(x: np.ndarray) -> np.ndarray:
    return x * np.clip(x / 6 + 0.5, 0, 1)


ACTIVATION_STEPS = pytest.mark.parametrize("step, reference", [(SILU, silu), (SIGMOID, sigmoid), (HARD_SWISH, hard_swish)],
                                           ids=["silu", "sigmoid", "hard_swish"])


@pytest.mark.parametrize("block", BLOCKS)
@ACTIVATION_STEPS
@pytest.mark.parametrize(
    "batch, in_c, size, out_c, kernel, stride",
    [
        (2, 32, (7, 7), 64, (1, 1), (1, 1)),  # row tiles (AVX-512)
        (1, 16, (11, 13), 48, (3, 3), (2, 2)),  # grid tiles, odd last block
        (1, 16, (9, 32), 16, (3, 3), (1, 1)),  # one block: row tiles of 16
        (1, 32, (11, 13), 64, (1, 1), (1, 1)),  # AVX-512: 4-block tiles
    ],
)
def test_blocked_direct_conv2d_activation_epilogues(block, step, reference, batch, in_c, size, out_c, kernel,
                                                    stride) -> None:
    """SiLU, sigmoid and hard-swish steps (applied to the stored tiles, not in registers) after
    a bias, on outputs out to +-90 (past exp's range for the naive formula, across
    hard-swish's breakpoints)."""
    load_extensions()
    pads = tuple(k // 2 for k in kernel)
    oh, ow = out_size(size, kernel, stride, pads, (1, 1))
    x, weight = rand(batch, in_c, *size, seed=1) * 6, rand(out_c, in_c, *kernel, seed=2)
    bias = rand(out_c, seed=3)
    y = tvm.runtime.tensor(np.full((batch, out_c // block, oh, ow, block), np.nan, np.float32))
    tvm.get_global_func(DIRECT_CONV2D_FUNC)(
        tvm.runtime.tensor(to_blocked(x, block)), tvm.runtime.tensor(pack_conv_weight(weight, block)),
        *stride, *pads, 1, 1, ADD_BLOCKED_VECTOR, tvm.runtime.tensor(bias), oh * ow * block, block,
        step, y)
    before = reference_conv(x, weight, stride, pads, (1, 1), (oh, ow)) + bias[:, None, None]
    assert np.abs(before).max() > 20
    np.testing.assert_allclose(from_blocked(y.numpy()), reference(before), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", BLOCKS)
@ACTIVATION_STEPS
@pytest.mark.parametrize("kernel, stride", [((3, 3), (1, 1)), ((5, 5), (1, 1)), ((5, 5), (2, 2)), ((7, 7), (1, 1))])
def test_blocked_depthwise_activation_epilogues(block, step, reference, kernel, stride) -> None:
    """The depthwise kernel's 3x3 and 5x5 instances (constant taps, strides 1 and 2) and its
    generic one (7x7), with SiLU, sigmoid or hard-swish after each row."""
    load_extensions()
    channels, size = 32, (15, 13)
    pads = tuple(k // 2 for k in kernel)
    oh, ow = out_size(size, kernel, stride, pads, (1, 1))
    x, weight = rand(1, channels, *size, seed=1) * 8, rand(channels, 1, *kernel, seed=2)
    packed = np.ascontiguousarray(weight.reshape(channels // block, block, 1, *kernel).transpose(0, 2, 3, 4, 1))
    y = tvm.runtime.tensor(np.full((1, channels // block, oh, ow, block), np.nan, np.float32))
    tvm.get_global_func(BLOCKED_DEPTHWISE_CONV2D_FUNC)(
        tvm.runtime.tensor(to_blocked(x, block)), tvm.runtime.tensor(packed), *stride, *pads, 1, 1, step, y)
    expected = np.zeros((1, channels, oh, ow))
    for c in range(channels):
        expected[:, c:c + 1] = reference_conv(x[:, c:c + 1], weight[c:c + 1], stride, pads, (1, 1), (oh, ow))[:, :1]
    np.testing.assert_allclose(from_blocked(y.numpy()), reference(expected), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("batch, channels, size", [(2, 32, (13, 13)), (1, 16, (3, 5)), (3, 48, (1, 1)), (1, 16, (56, 56))])
def test_spatial_mean_against_numpy(block, batch, channels, size) -> None:
    load_extensions()
    x = rand(batch, channels, *size, seed=4) + 3
    y = tvm.runtime.tensor(np.full((batch, channels // block, 1, 1, block), np.nan, np.float32))
    tvm.get_global_func(SPATIAL_MEAN_FUNC)(tvm.runtime.tensor(to_blocked(x, block)), y)
    expected = x.astype(np.float64).mean(axis=(2, 3), keepdims=True)
    np.testing.assert_allclose(from_blocked(y.numpy()), expected, rtol=1e-6)


def test_spatial_mean_rejects_mismatched_shapes() -> None:
    load_extensions()
    x = tvm.runtime.tensor(np.zeros((1, 2, 4, 4, 16), np.float32))
    y = tvm.runtime.tensor(np.zeros((1, 1, 1, 1, 16), np.float32))
    with pytest.raises(RuntimeError, match="nchwc_spatial_mean"):
        tvm.get_global_func(SPATIAL_MEAN_FUNC)(x, y)


def block_net(channels: int = 16, seed: int = 0) -> onnx.ModelProto:
    """A small CNN with every op the pass converts: 3x3 conv + ReLU, max pool, a stride-2 3x3
    conv, a 1x1 conv with a residual add, a depthwise conv with Clip (ReLU6), then global
    pooling and flatten (the edge), on [N, channels, 15, 15] (odd sizes, padding)."""
    rng = np.random.default_rng(seed)
    c, c2 = channels, 2 * channels
    weights = {
        "w1": rng.standard_normal((c, c, 3, 3), dtype=np.float32) * 0.2,
        "b1": rng.standard_normal(c, dtype=np.float32),
        "w2": rng.standard_normal((c2, c, 3, 3), dtype=np.float32) * 0.2,
        "b2": rng.standard_normal(c2, dtype=np.float32),
        "w3": rng.standard_normal((c2, c2, 1, 1), dtype=np.float32) * 0.2,
        "w4": rng.standard_normal((c2, 1, 3, 3), dtype=np.float32) * 0.5,
        "b4": rng.standard_normal(c2, dtype=np.float32),
        "lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("Conv", ["r2", "w3"], ["c3"]),
        helper.make_node("Add", ["c3", "r2"], ["a3"]),
        helper.make_node("Relu", ["a3"], ["r3"]),
        helper.make_node("Conv", ["r3", "w4", "b4"], ["c4"], pads=[1, 1, 1, 1], group=c2),
        helper.make_node("Clip", ["c4", "lo", "hi"], ["r4"]),
        helper.make_node("GlobalAveragePool", ["r4"], ["g"]),
        helper.make_node("Flatten", ["g"], ["y"]),
    ]
    return onnx_model(nodes, [("x", ["N", c, 15, 15])], ("y", ["N", c2]), weights)


def se_net(channels: int = 32, seed: int = 0, batch: int | str = "N") -> onnx.ModelProto:
    """An EfficientNet block as torch exports it: SiLU written as x * sigmoid(x), a 5x5
    depthwise conv, a squeeze-and-excitation gate (global pooling, a 1x1 conv down to a
    quarter of the channels (off the block) with SiLU, a 1x1 conv back up, sigmoid, times the
    block's activations) and a 1x1 projection, on [batch, 3, 17, 17]."""
    rng = np.random.default_rng(seed)
    c, r = channels, channels // 4

    def normal(*shape, scale=0.3):
        return rng.standard_normal(shape, dtype=np.float32) * scale

    weights = {"w1": normal(c, 3, 3, 3), "b1": normal(c), "w2": normal(c, 1, 5, 5), "b2": normal(c),
               "wr": normal(r, c, 1, 1), "br": normal(r), "we": normal(c, r, 1, 1), "be": normal(c),
               "wp": normal(c, c, 1, 1)}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Sigmoid", ["c1"], ["s1"]),
        helper.make_node("Mul", ["c1", "s1"], ["a1"]),
        helper.make_node("Conv", ["a1", "w2", "b2"], ["c2"], pads=[2, 2, 2, 2], group=c),
        helper.make_node("Sigmoid", ["c2"], ["s2"]),
        helper.make_node("Mul", ["s2", "c2"], ["a2"]),
        helper.make_node("GlobalAveragePool", ["a2"], ["squeezed"]),
        helper.make_node("Conv", ["squeezed", "wr", "br"], ["cr"]),
        helper.make_node("Sigmoid", ["cr"], ["sr"]),
        helper.make_node("Mul", ["cr", "sr"], ["ar"]),
        helper.make_node("Conv", ["ar", "we", "be"], ["ce"]),
        helper.make_node("Sigmoid", ["ce"], ["gate"]),
        helper.make_node("Mul", ["a2", "gate"], ["gated"]),
        helper.make_node("Conv", ["gated", "wp"], ["p"]),
        helper.make_node("GlobalAveragePool", ["p"], ["g"]),
        helper.make_node("Flatten", ["g"], ["y"]),
    ]
    return onnx_model(nodes, [("x", [batch, 3, 17, 17])], ("y", [batch, c]), weights)


@pytest.mark.parametrize("block", BLOCKS)
def test_squeeze_and_excitation_runs_blocked(block, monkeypatch) -> None:
    """The gate's product with the activations runs on the blocked layout (the gate,
    [N, C / B, 1, 1, B], broadcast over the pixels), so the region needs no conversion: the
    stem reads the NCHW input, both global poolings average blocked data, the gate's up conv
    reads the NCHW squeeze and writes blocked (with 8-channel blocks, the down conv's 8 channels
    fill a block: the squeeze is reshaped into the blocked layout, one pixel needing no
    conversion); every SiLU and the sigmoid are conv epilogues."""
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, str(block))
    script = dispatched(se_net())
    assert script.count(f'"{TO_BLOCKED_FUNC}"') == 0 and script.count(f'"{FROM_BLOCKED_FUNC}"') == 0
    assert script.count(f'"{SPATIAL_MEAN_FUNC}"') == 2
    assert "R.sigmoid(" not in script and "R.nn.silu(" not in script
    assert "R.multiply(" in script
    assert_matches_onnxruntime(se_net(), {"x": rand(2, 3, 17, 17, seed=6)})


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("channels, batch, scaled", [(16, 1, True), (16, 2, False), (32, 1, False)])
def test_squeeze_and_excitation_gate_scales_the_projection(block, channels, batch, scaled, monkeypatch) -> None:
    """For one image, the gate's product is the projection conv's scale (its weight scaled
    per input channel, no multiply left: 16 channels, 4 * 16 weights a channel against 9 * 9
    pixels); for two, each image has its own gate and the product stays; with 32 channels
    (4 * 32 > 81) the weight is too large to scale on every call."""
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, str(block))
    script = dispatched(se_net(channels, batch=batch))
    assert script.count(f'"{SCALED_DIRECT_CONV2D_FUNC}"') == int(scaled)
    assert ("R.multiply(" in script) != scaled
    assert_matches_onnxruntime(se_net(channels, batch=batch), {"x": rand(batch, 3, 17, 17, seed=6)})


@pytest.mark.parametrize("block", BLOCKS)
def test_scaled_input_of_an_entry_conv_stays_a_product(block, monkeypatch) -> None:
    """An NCHW input scaled per channel (a normalization) before the region's entry conv: the
    product stays a product (the scaled kernel takes blocked data only) and the model runs."""
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, str(block))
    weights = {"s": rand(1, 3, 1, 1, seed=2), "w": rand(32, 3, 3, 3, seed=3)}
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Conv", ["xs", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["g"]),
             helper.make_node("Flatten", ["g"], ["y"])]
    model = onnx_model(nodes, [("x", [1, 3, 16, 16])], ("y", [1, 32]), weights)
    script = dispatched(model)
    assert "R.multiply(" in script and f'"{SCALED_DIRECT_CONV2D_FUNC}"' not in script
    assert_matches_onnxruntime(model, {"x": rand(1, 3, 16, 16, seed=6)})


def concat_net(seed: int = 0) -> onnx.ModelProto:
    """A SqueezeNet fire module (1x1 squeeze, 1x1 and 3x3 expands concatenated) followed by a
    DenseNet layer (batch norm and ReLU before its conv, which no conv can fold, and the
    conv's output concatenated to its input), on [N, 16, 11, 11]."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=0.3):
        return rng.standard_normal(shape, dtype=np.float32) * scale

    weights = {"ws": normal(16, 16, 1, 1), "w1": normal(32, 16, 1, 1), "w3": normal(32, 16, 3, 3),
               "gamma": normal(64) + 1, "beta": normal(64), "mean": normal(64),
               "var": rng.uniform(0.5, 1.5, 64).astype(np.float32), "wd": normal(16, 64, 3, 3)}
    nodes = [
        helper.make_node("Conv", ["x", "ws"], ["s"]),
        helper.make_node("Relu", ["s"], ["rs"]),
        helper.make_node("Conv", ["rs", "w1"], ["e1"]),
        helper.make_node("Relu", ["e1"], ["r1"]),
        helper.make_node("Conv", ["rs", "w3"], ["e3"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["e3"], ["r3"]),
        helper.make_node("Concat", ["r1", "r3"], ["fire"], axis=1),
        helper.make_node("BatchNormalization", ["fire", "gamma", "beta", "mean", "var"], ["bn"]),
        helper.make_node("Relu", ["bn"], ["rbn"]),
        helper.make_node("Conv", ["rbn", "wd"], ["d"], pads=[1, 1, 1, 1]),
        helper.make_node("Concat", ["fire", "d"], ["dense"], axis=1),
        helper.make_node("GlobalAveragePool", ["dense"], ["g"]),
        helper.make_node("Flatten", ["g"], ["y"]),
    ]
    return onnx_model(nodes, [("x", ["N", 16, 11, 11])], ("y", ["N", 80]), weights)


@pytest.mark.parametrize("block", BLOCKS)
def test_channel_concats_run_blocked(block, monkeypatch) -> None:
    """Concats along the channels of blocked values stay blocked (a concat of the channel
    blocks), and so do a batch norm's elementwise ops and ReLU between a concat and a conv:
    one conversion (the NCHW input into the first conv), none back."""
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, str(block))
    script = dispatched(concat_net())
    assert script.count(f'"{TO_BLOCKED_FUNC}"') == 1 and script.count(f'"{FROM_BLOCKED_FUNC}"') == 0
    assert script.count("R.concat(") == 2
    assert_matches_onnxruntime(concat_net(), {"x": rand(2, 16, 11, 11, seed=7)})


def fire_net(batch: int, expand_read_elsewhere: bool = False) -> onnx.ModelProto:
    """A SqueezeNet fire module on [batch, 32, 9, 9]: a 1x1 squeeze to 16 channels, 1x1 and 3x3
    expands to 32 each (ReLU after each) concatenated; with `expand_read_elsewhere`, the 1x1
    expand's output is also added to the concat's first half."""
    rng = np.random.default_rng(5)

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32) * 0.3

    weights = {"ws": normal(16, 32, 1, 1), "w1": normal(32, 16, 1, 1), "b1": normal(32),
               "w3": normal(32, 16, 3, 3), "b3": normal(32)}
    nodes = [
        helper.make_node("Conv", ["x", "ws"], ["s"]),
        helper.make_node("Relu", ["s"], ["rs"]),
        helper.make_node("Conv", ["rs", "w1", "b1"], ["e1"]),
        helper.make_node("Relu", ["e1"], ["r1"]),
        helper.make_node("Conv", ["rs", "w3", "b3"], ["e3"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["e3"], ["r3"]),
        helper.make_node("Concat", ["r1", "r3"], ["fire"], axis=1),
    ]
    if expand_read_elsewhere:
        nodes.append(helper.make_node("Concat", ["r1", "r1"], ["twice"], axis=1))
        nodes.append(helper.make_node("Add", ["fire", "twice"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", ["fire"], ["y"]))
    return onnx_model(nodes, [("x", [batch, 32, 9, 9])], ("y", [batch, 64, 9, 9]), weights)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("batch, read_elsewhere, in_place", [(1, False, True), (2, False, False), (1, True, False)])
def test_fire_module_convs_write_into_the_concat(block, batch, read_elsewhere, in_place, monkeypatch) -> None:
    """For one image, the fire module's expand convs write their outputs into the concat's
    (one `gimlet.cpu.conv2d_nchwc_direct_concat` call, bias and ReLU in each part's epilogue;
    no concat left); for two images (whose blocks do not follow each other) or an expand read
    elsewhere too, the concat stays. Each computes what onnxruntime does."""
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, str(block))
    model = fire_net(batch, read_elsewhere)
    script = dispatched(model)
    assert script.count(f'"{CONCAT_FUNC}"') == (1 if in_place else 0)
    assert ("R.concat(" in script) != in_place
    assert_matches_onnxruntime(model, {"x": rand(batch, 32, 9, 9, seed=10)})


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("batch", [1, 2])
def test_convs_written_into_a_concat_stay_direct(block, batch, monkeypatch) -> None:
    """The fire module's 3x3 expand conv, with Winograd wanted for every 3x3 stride-1 conv:
    for one image, where the concat is written in place, on the direct kernel (the only one
    that writes there) and no op group for kernel selection (a group's timing would not see
    the concat's copy that another kernel brings); for two images on Winograd, an op group."""
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, str(block))
    monkeypatch.setenv(WINOGRAD_ENV, "4")
    model = fire_net(batch)
    script = dispatched(model)
    assert script.count(f'"{WINOGRAD_CONV2D_FUNC}"') == batch - 1
    assert script.count(f'"{CONCAT_FUNC}"') == (batch == 1)
    mod, _ = import_model(model, {"x": (batch, 32, 9, 9)})
    assert [sig.op for sig in op_signatures(mod, resolve_target("llvm")[1])].count("conv2d_nchwc") == batch - 1
    assert_matches_onnxruntime(model, {"x": rand(batch, 32, 9, 9, seed=10)})


def test_concat_call_checks_its_parts() -> None:
    """The concat call's parts must fill its output's channel blocks exactly: a part too many
    or too few is an error, not a write past the output."""
    load_extensions()
    block = 8
    x = tvm.runtime.tensor(to_blocked(rand(1, 8, 5, 5, seed=1), block))
    weight = tvm.runtime.tensor(pack_conv_weight(rand(8, 8, 1, 1, seed=2), block))
    part = [x, weight, 1, 1, 0, 0, 1, 1, 0]
    concat = tvm.get_global_func(CONCAT_FUNC)
    for parts, blocks in ((1, 2), (3, 2)):
        out = tvm.runtime.tensor(np.zeros((1, blocks, 5, 5, block), np.float32))
        with pytest.raises(Exception, match="channel blocks|blocks \\["):
            concat(*(part * parts), out)


def assert_matches_onnxruntime(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> None:
    """The model built for this CPU computes what onnxruntime does."""
    ours = gimlet_tvm.build(model, "llvm")(*inputs.values())
    reference = onnxruntime.InferenceSession(model.SerializeToString(),
                                             providers=["CPUExecutionProvider"]).run(None, inputs)
    for got, expected in zip(ours, reference):
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def lowered(model: onnx.ModelProto) -> tvm.IRModule:
    """The model after the graph and library passes."""
    mod, _ = import_model(model)
    return tvm.transform.Sequential([*graph_passes(), *layout_passes(host_spec()), *library_passes(host_spec())])(mod)


def dispatched(model: onnx.ModelProto) -> str:
    """The model's main function after the graph and library passes, as TVMScript."""
    return lowered(model)["main"].script()


@pytest.mark.parametrize("block", BLOCKS)
def test_conversions_only_at_the_edges(block, monkeypatch) -> None:
    """One conversion into the blocked layout (before the first conv) and none back: global
    pooling averages the blocked data, whose one-pixel result is reshaped to NCHW; none
    around the max pool (the library's, on the blocked data), the residual add or the epilogues; activations get no
    `R.layout_transform` (only constant weights do, folded at build time)."""
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, str(block))
    script = dispatched(block_net())
    assert script.count(f'"{TO_BLOCKED_FUNC}"') == 1
    assert script.count(f'"{FROM_BLOCKED_FUNC}"') == 0
    assert script.count(f'"{SPATIAL_MEAN_FUNC}"') == 1
    assert script.count(f'"{DIRECT_CONV2D_FUNC}"') == 3
    assert script.count(f'"{BLOCKED_DEPTHWISE_CONV2D_FUNC}"') == 1
    assert script.count(f'"{BLOCKED_MAX_POOL_FUNC}"') == 1 and "R.nn.max_pool2d" not in script
    for line in script.splitlines():
        if "R.layout_transform(" in line:
            assert 'R.layout_transform(metadata["ir.GenericConst"]' in line, line
    # Bias, residual and clip went into the kernels' epilogues.
    assert "R.add(" not in script and "R.minimum(" not in script and "R.nn.relu(" not in script


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("tile", ["2", "4"])
def test_winograd_convs_run_blocked(block, tile, monkeypatch) -> None:
    """With Winograd for every 3x3 stride-1 conv, `block_net`'s first conv runs it on the
    blocked data (the network's one conversion before it), its weight transformed as
    [alpha^2, C / B, B, O], its bias and ReLU in its epilogue; the model computes what
    onnxruntime does."""
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, str(block))
    monkeypatch.setenv(WINOGRAD_ENV, tile)
    model = block_net()
    main = lowered(model)["main"]
    script = main.script()
    assert script.count(f'"{TO_BLOCKED_FUNC}"') == 1 and script.count(f'"{FROM_BLOCKED_FUNC}"') == 0
    exprs = []
    tvm.relax.analysis.post_order_visit(main.body, exprs.append)
    winograd = [e for e in exprs if isinstance(e, tvm.relax.Call) and e.args
                and getattr(e.args[0], "global_symbol", None) == WINOGRAD_CONV2D_FUNC]
    assert len(winograd) == 1
    data, weight = winograd[0].args[1].fields[:2]
    assert data.ty.ndim == 5 and winograd[0].ty_args[0].ndim == 5
    assert tuple(weight.value.shape) == ((int(tile) + 2) ** 2, 16 // block, block, 16)
    assert script.count(f'"{DIRECT_CONV2D_FUNC}"') == 2
    assert "R.add(" not in script and "R.nn.relu(" not in script
    inputs = {"x": rand(2, 16, 15, 15, seed=8)}
    assert_matches_onnxruntime(model, inputs)


def test_channels_off_the_block_stay_nchw(monkeypatch) -> None:
    """20 and 40 channels are no multiples of 16: nothing is converted. With 8-channel blocks,
    the 20 -> 20 conv stays NCHW; the 20 -> 40 conv is an entry conv (NCHW data, blocked
    output), so the 40-channel region (1x1 conv, residual add, depthwise conv, global
    pooling) starts there with no conversion and ends at the pooling's one-pixel result."""
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, "16")
    assert TO_BLOCKED_FUNC not in dispatched(block_net(20))
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, "8")
    script = dispatched(block_net(20))
    assert script.count(f'"{TO_BLOCKED_FUNC}"') == 0 and script.count(f'"{FROM_BLOCKED_FUNC}"') == 0
    assert f'R.call_dps_packed("{SPATIAL_MEAN_FUNC}", (lv' in script and "out_ty=R.Tensor((N, 5, 1, 1, 8)" in script
    # The 20 -> 20 conv (NCHW, the default rule's kernel), the entry conv and the 1x1 conv.
    assert script.count(f'"{DIRECT_CONV2D_FUNC}"') == 3
    assert script.count(f'"{BLOCKED_DEPTHWISE_CONV2D_FUNC}"') == 1


def padded_net(out_c: int = 16, seed: int = 0) -> onnx.ModelProto:
    """A MobileNetV3 block on 60 channels (off both blocks; padded to 64 with either):
    a 1x1 expansion with hard-swish, a 3x3 depthwise conv with ReLU, a squeeze-and-excitation
    gate (down to 16 channels and back up, ONNX HardSigmoid), a division by a per-channel
    constant, a 1x1 projection to `out_c` channels, global pooling, on [N, 16, 11, 11]."""
    rng = np.random.default_rng(seed)
    c = 60

    def normal(*shape, scale=0.3):
        return rng.standard_normal(shape, dtype=np.float32) * scale

    weights = {"we": normal(c, 16, 1, 1), "be": normal(c), "wd": normal(c, 1, 3, 3), "bd": normal(c),
               "wr": normal(16, c, 1, 1), "br": normal(16), "wu": normal(c, 16, 1, 1), "bu": normal(c),
               "scale": rng.uniform(0.5, 2.0, (1, c, 1, 1)).astype(np.float32), "wp": normal(out_c, c, 1, 1)}
    nodes = [
        helper.make_node("Conv", ["x", "we", "be"], ["ce"]),
        helper.make_node("HardSwish", ["ce"], ["he"]),
        helper.make_node("Conv", ["he", "wd", "bd"], ["cd"], pads=[1, 1, 1, 1], group=c),
        helper.make_node("Relu", ["cd"], ["rd"]),
        helper.make_node("GlobalAveragePool", ["rd"], ["squeezed"]),
        helper.make_node("Conv", ["squeezed", "wr", "br"], ["cr"]),
        helper.make_node("Relu", ["cr"], ["rr"]),
        helper.make_node("Conv", ["rr", "wu", "bu"], ["cu"]),
        helper.make_node("HardSigmoid", ["cu"], ["gate"], alpha=1 / 6, beta=0.5),
        helper.make_node("Mul", ["rd", "gate"], ["gated"]),
        helper.make_node("Div", ["gated", "scale"], ["scaled"]),
        helper.make_node("Conv", ["scaled", "wp"], ["p"]),
        helper.make_node("GlobalAveragePool", ["p"], ["g"]),
        helper.make_node("Flatten", ["g"], ["y"]),
    ]
    return onnx_model(nodes, [("x", ["N", 16, 11, 11])], ("y", ["N", out_c]), weights)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("out_c", [16, 20])  # the projection blocked, or an exit conv (to NCHW)
def test_channels_off_the_block_run_padded(block, out_c, monkeypatch) -> None:
    """60 channels run blocked as 64, the padding zero channels of the convs' weights: one
    conversion (the input into the first conv), none back (an exit conv reads the padded data
    through zero input channels); the squeeze's slice of the padded mean is the only strided
    slice; the hard-swish is the expansion's epilogue; the model computes what onnxruntime does (no NaN out of the
    padding: the divisor's is 1)."""
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, str(block))
    model = padded_net(out_c)
    script = dispatched(model)
    assert script.count(f'"{TO_BLOCKED_FUNC}"') == 1 and script.count(f'"{FROM_BLOCKED_FUNC}"') == 0
    assert script.count(f'"{BLOCKED_DEPTHWISE_CONV2D_FUNC}"') == 1
    assert script.count("R.strided_slice(") == 1 and "R.clip(" in script  # the gate's hard-sigmoid
    assert f"R.Tensor((N, {64 // block}, 11, 11, {block})" in script
    assert_matches_onnxruntime(model, {"x": rand(2, 16, 11, 11, seed=9)})


def resnext_net(groups: int) -> onnx.ModelProto:
    """A ResNeXt bottleneck on [N, 64, 10, 10]: a 1x1 conv to 64 channels with ReLU, a 3x3 conv
    of `groups` groups with ReLU, a 1x1 conv back to 64, the residual add and ReLU, global
    pooling."""
    rng = np.random.default_rng(6)

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32) * 0.2

    weights = {"w1": normal(64, 64, 1, 1), "b1": normal(64), "wg": normal(64, 64 // groups, 3, 3),
               "bg": normal(64), "w3": normal(64, 64, 1, 1), "b3": normal(64)}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "wg", "bg"], ["cg"], pads=[1, 1, 1, 1], group=groups),
        helper.make_node("Relu", ["cg"], ["rg"]),
        helper.make_node("Conv", ["rg", "w3", "b3"], ["c3"]),
        helper.make_node("Add", ["c3", "x"], ["a"]),
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["g"]),
        helper.make_node("Flatten", ["g"], ["y"]),
    ]
    return onnx_model(nodes, [("x", ["N", 64, 10, 10])], ("y", ["N", 64]), weights)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("groups, blocked", [(4, True), (16, False)])
def test_grouped_convs_of_whole_blocks_run_blocked(block, groups, blocked, monkeypatch) -> None:
    """A grouped conv whose groups hold whole channel blocks (4 of 16 channels) runs blocked on
    the direct kernel: the network's one conversion is its input's; one that splits blocks (16
    of 4) stays NCHW, converted out of the region and back in. Both compute what onnxruntime
    does."""
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, str(block))
    model = resnext_net(groups)
    script = dispatched(model)
    assert script.count(f'"{TO_BLOCKED_FUNC}"') == (1 if blocked else 2)
    assert script.count(f'"{FROM_BLOCKED_FUNC}"') == (0 if blocked else 1)
    assert script.count(f'"{DIRECT_CONV2D_FUNC}"') == (3 if blocked else 2)
    assert_matches_onnxruntime(model, {"x": rand(2, 64, 10, 10, seed=11)})


def exit_net() -> onnx.ModelProto:
    """16 -> 32 channels (3x3 + ReLU), then a 1x1 conv to 20 channels (+ bias, ReLU): 20 is no
    multiple of a block, so the second conv is an exit conv."""
    rng = np.random.default_rng(4)
    weights = {
        "w1": rng.standard_normal((32, 16, 3, 3), dtype=np.float32) * 0.2,
        "b1": rng.standard_normal(32, dtype=np.float32),
        "w2": rng.standard_normal((20, 32, 1, 1), dtype=np.float32) * 0.2,
        "b2": rng.standard_normal(20, dtype=np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"]),
        helper.make_node("Relu", ["c2"], ["y"]),
    ]
    return onnx_model(nodes, [("x", ["N", 16, 9, 11])], ("y", ["N", 20, 9, 11]), weights)


@pytest.mark.parametrize("block", BLOCKS)
def test_exit_conv_ends_the_region_without_a_conversion(block, monkeypatch) -> None:
    """A conv from blocked data to a channel count off the block reads the blocked data and
    writes NCHW (its bias and ReLU in its epilogue): one conversion into the region, none out;
    the model computes what onnxruntime does."""
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, str(block))
    model = exit_net()
    script = dispatched(model)
    assert script.count(f'"{TO_BLOCKED_FUNC}"') == 1 and script.count(f'"{FROM_BLOCKED_FUNC}"') == 0
    assert script.count(f'"{DIRECT_CONV2D_FUNC}"') == 2
    assert "R.add(" not in script and "R.nn.relu(" not in script
    inputs = {"x": rand(2, 16, 9, 11, seed=7)}
    assert_matches_onnxruntime(model, inputs)


def test_default_rule_converts_networks_with_convertible_convs(monkeypatch) -> None:
    """Networks with convs whose channel counts are multiples of the CPU's block run blocked;
    the MLP (no conv) is left alone."""
    monkeypatch.delenv(BLOCKED_LAYOUT_ENV, raising=False)
    block = direct_conv_block()
    if block == 0:
        pytest.skip("no blocked kernels on this CPU")
    # (Both regions end at global pooling on blocked data: the library's mean over a 5-D tensor.)
    blocked_mean = re.compile(rf'"{SPATIAL_MEAN_FUNC}", \(\w+,\), out_ty=R\.Tensor\(\(\w+, \d+, 1, 1, {block}\)')
    assert blocked_mean.search(dispatched(models.SUITE["mobilenet_cnn"].build()))
    assert blocked_mean.search(dispatched(models.SUITE["resnet_cnn"].build()))
    script = dispatched(models.SUITE["mlp"].build())
    assert FROM_BLOCKED_FUNC not in script and TO_BLOCKED_FUNC not in script and not blocked_mean.search(script)


@pytest.mark.parametrize("setting", ["", "8", "16"])
@pytest.mark.parametrize("name", ["block_net", "block_net_20", "mobilenet_cnn", "resnet_cnn"])
def test_blocked_models_against_onnxruntime(name, setting, monkeypatch) -> None:
    """Whole models built with the pass (default rule, or every function with 8- or 16-channel
    blocks) against onnxruntime."""
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, setting)
    if name.startswith("block_net"):
        channels = 20 if name.endswith("20") else 16
        model, inputs = block_net(channels), {"x": rand(3, channels, 15, 15, seed=5)}
    else:
        model, inputs = models.SUITE[name].build(), models.SUITE[name].example_inputs(batch=3)
    assert_matches_onnxruntime(model, inputs)


def test_kernel_selection_leaves_blocked_convs_on_their_kernels(tmp_path, monkeypatch) -> None:
    """Kernel selection sees the module after the blocked layout: a blocked conv the library
    has no choice of algorithms for is no op group. A selection choosing im2col for every conv
    op group of `block_net(20)` with 8-channel blocks (the 20 -> 20 conv stays NCHW; the 20 ->
    40 one is the region's entry conv) runs it on im2col, keeps the 40-channel region blocked on
    its kernels (up to global pooling), and the model computes what onnxruntime does."""
    if direct_conv_block() == 0:
        pytest.skip("no blocked kernels on this CPU")
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, "8")
    model, shapes = block_net(20), {"x": (3, 20, 15, 15)}  # static: op groups need static shapes
    spec, target = resolve_target("llvm")
    mod, _ = import_model(model, shapes)
    convs = {sig: count for sig, count in op_signatures(mod, target).items() if sig.op == "conv2d"}
    assert sorted(sig.shapes[1] for sig in convs) == [(20, 20, 3, 3)]
    chosen = "library:conv_im2col"
    selection = KernelSelection(target_key(target), {
        sig.key: OpChoice(sig, [Tried(chosen, "", True, seconds=1.0)], chosen, count) for sig, count in convs.items()})
    with target:
        script = tvm.transform.Sequential(kernel_passes([(spec, target)], selection.pass_for(target)))(mod)["main"].script()
    assert script.count(f'"{IM2COL_CONV2D_FUNC}"') == 1
    assert script.count(f'"{TO_BLOCKED_FUNC}"') == 0 and script.count(f'"{FROM_BLOCKED_FUNC}"') == 0
    assert re.search(rf'"{SPATIAL_MEAN_FUNC}", \(\w+,\), out_ty=R\.Tensor\(\(3, 5, 1, 1, 8\)', script)
    assert script.count(f'"{DIRECT_CONV2D_FUNC}"') == 2 and script.count(f'"{BLOCKED_DEPTHWISE_CONV2D_FUNC}"') == 1
    inputs = {"x": rand(3, 20, 15, 15, seed=8)}
    ours = gimlet_tvm.build(model, "llvm", input_shapes=shapes, selection=selection)(*inputs.values())
    reference = onnxruntime.InferenceSession(model.SerializeToString(),
                                             providers=["CPUExecutionProvider"]).run(None, inputs)
    np.testing.assert_allclose(np.asarray(ours[0]), reference[0], rtol=1e-4, atol=1e-4 * np.abs(reference[0]).max())


def test_blocked_conv_reference_is_the_nchw_conv_between_layouts() -> None:
    """The reference blocked-conv op groups are checked against: the NCHW reference conv on the
    data taken out of blocks, its output put into them (stride 2, asymmetric padding)."""
    rng = np.random.default_rng(11)
    data, weight = rng.standard_normal((2, 2, 9, 7, 8)), rng.standard_normal((16, 16, 3, 3))
    attrs = tuple(zip(("stride_h", "stride_w", "pad_top", "pad_left", "pad_bottom", "pad_right",
                       "dilation_h", "dilation_w", "groups"), (2.0, 2, 1, 0, 0, 1, 1, 1, 1)))
    got = OP_KINDS["conv2d_nchwc"].reference([data, weight], attrs)
    want = to_blocked(OP_KINDS["conv2d"].reference([from_blocked(data), weight], attrs), 8)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got.shape == OP_KINDS["conv2d_nchwc"].out_shape((data.shape, weight.shape), attrs) == (2, 2, 4, 3, 8)


@pytest.mark.parametrize("block", BLOCKS)
def test_blocked_convs_with_a_choice_are_op_groups(block, tmp_path, monkeypatch) -> None:
    """On blocked data, a conv the library can run several ways (3x3, stride 1: Winograd F(4x4)
    and F(2x2) beside the direct kernel) is an op group of its own kind; the others (strided,
    1x1, depthwise) stay on their kernels. Selection verifies each algorithm against the
    float64 reference and picks one of them; a selection choosing each in turn puts that
    kernel's call in the built model (its weight transformed or packed at build time), and
    the model computes what onnxruntime does."""
    if direct_conv_block() == 0:
        pytest.skip("no blocked kernels on this CPU")
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, str(block))
    model, shapes = block_net(16), {"x": (2, 16, 15, 15)}
    spec, target = resolve_target("llvm")
    mod, _ = import_model(model, shapes)
    groups = [sig for sig in op_signatures(mod, target) if sig.op.startswith("conv2d")]
    blocks = 16 // block
    assert [sig.key for sig in groups] == [
        f"conv2d_nchwc float32 2x{blocks}x15x15x{block} * const 16x16x3x3 +1x{blocks}x1x1x{block} relu "
        "stride 1x1 pad 1,1,1,1 dilation 1x1 groups 1"]
    (sig,) = groups
    available = [c.id for c in candidates(sig, target) if c.unavailable is None]
    assert available == ["library:conv_winograd4", "library:conv_winograd2", f"library:conv_direct{block}"]
    selection = select_kernels(mod, target, records=str(tmp_path), timeout=180)
    choice = selection.choices[sig.key]
    assert sorted(t.id for t in choice.tried if t.verified) == sorted(available) and choice.winner in available
    inputs = {"x": rand(2, 16, 15, 15, seed=9)}
    reference = onnxruntime.InferenceSession(model.SerializeToString(),
                                             providers=["CPUExecutionProvider"]).run(None, inputs)
    for chosen in available:
        tried = [Tried(chosen, "", True, seconds=1.0)]
        picked = KernelSelection(target_key(target), {sig.key: OpChoice(sig, tried, chosen)})
        with target:
            passes = kernel_passes([(spec, target)], picked.pass_for(target))
            script = tvm.transform.Sequential(passes)(mod)["main"].script()
        func = CONV_ALGORITHMS[chosen.removeprefix("library:conv_")].func
        assert script.count(f'"{WINOGRAD_CONV2D_FUNC}"') == (func == WINOGRAD_CONV2D_FUNC)
        assert script.count(f'"{DIRECT_CONV2D_FUNC}"') == 2 + (func == DIRECT_CONV2D_FUNC)
        assert f'"{BLOCKED_CONV2D_FUNC}"' not in script and "R.nn.relu(" not in script
        ours = gimlet_tvm.build(model, "llvm", input_shapes=shapes, selection=picked)(*inputs.values())
        np.testing.assert_allclose(np.asarray(ours[0]), reference[0], rtol=1e-4,
                                   atol=1e-4 * np.abs(reference[0]).max(), err_msg=chosen)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("size", [(5, 7), (9, 13), (32, 32)])  # plane sizes below, past and at 8s
@pytest.mark.parametrize("short", [0, 3])  # channels short of two whole blocks: padding
def test_layout_conversions_against_numpy(block, size, short) -> None:
    """NCHW to NCHW{B}c and back, with the last block's padding channels written as 0 and
    dropped on the way back."""
    load_extensions()
    x = rand(3, 2 * block - short, *size, seed=6)
    blocked = tvm.runtime.tensor(np.full((3, 2, *size, block), np.nan, np.float32))
    tvm.get_global_func(TO_BLOCKED_FUNC)(tvm.runtime.tensor(x), blocked)
    np.testing.assert_array_equal(blocked.numpy(), to_blocked(x, block))
    back = tvm.runtime.tensor(np.full(x.shape, np.nan, np.float32))
    tvm.get_global_func(FROM_BLOCKED_FUNC)(blocked, back)
    np.testing.assert_array_equal(back.numpy(), x)


def test_bad_setting_is_a_compile_error(monkeypatch) -> None:
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, "4")
    with pytest.raises(CompileError, match="GIMLET_CPU_BLOCKED_LAYOUT must be 0, 8 or 16"):
        gimlet_tvm.build(block_net(), "llvm")
