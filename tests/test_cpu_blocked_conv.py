"""Kernels on channel-blocked NCHW{B}c data (`gimlet.cpu.conv2d_nchw_direct` with 5-D data
and output, `gimlet.cpu.conv2d_nchwc_depthwise`) against numpy, and the blocked-layout pass
(`relax_passes.blocked_layout`) on whole models against onnxruntime, with its layout
transforms of activations only at the edges of the blocked regions.

8-channel blocks run the AVX2 instances, 16-channel blocks the AVX-512 ones (or the AVX2 ones
on 16-lane vectors on a CPU without AVX-512).
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from gimlet_tvm.relax_passes.dispatch_cpu_library import (
    DIRECT_CONV2D_FUNC, BLOCKED_DEPTHWISE_CONV2D_FUNC, pack_conv_weight)
from gimlet_tvm.runtime.extensions import load_extensions

from .test_cpu_direct_conv import reference_conv
from .test_cpu_library import rand

ADD_TENSOR, RELU, CLIP, ADD_BLOCKED_VECTOR = 1, 2, 3, 5
BLOCKS = [8, 16]


def to_blocked(x: np.ndarray, block: int) -> np.ndarray:
    """NCHW as NCHW{block}c (channels a multiple of block)."""
    n, c, h, w = x.shape
    return np.ascontiguousarray(x.reshape(n, c // block, block, h, w).transpose(0, 1, 3, 4, 2))


def from_blocked(x: np.ndarray) -> np.ndarray:
    n, cb, h, w, b = x.shape
    return x.transpose(0, 1, 4, 2, 3).reshape(n, cb * b, h, w)


def out_size(size, kernel, stride, pads, dilation):
    return tuple((s + 2 * p - d * (k - 1) - 1) // st + 1
                 for s, k, st, p, d in zip(size, kernel, stride, pads, dilation))


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("blocked_in", [True, False])
@pytest.mark.parametrize(
    "batch, in_c, size, out_c, kernel, stride, pads, dilation",
    [
        (2, 32, (7, 9), 48, (1, 1), (1, 1), (0, 0), (1, 1)),  # 1x1: a GEMM, odd plane
        (1, 16, (9, 11), 32, (1, 1), (2, 2), (0, 0), (1, 1)),  # 1x1 stride 2
        (2, 16, (13, 11), 16, (3, 3), (1, 1), (1, 1), (1, 1)),  # one output block
        (1, 32, (15, 14), 64, (3, 3), (2, 2), (1, 1), (1, 1)),  # stride 2
        (1, 16, (12, 10), 32, (3, 3), (1, 1), (2, 2), (2, 2)),  # dilated
    ],
)
def test_blocked_direct_conv2d_against_numpy(block, blocked_in, batch, in_c, size, out_c, kernel,
                                             stride, pads, dilation) -> None:
    load_extensions()
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
        ADD_TENSOR, tvm.runtime.tensor(to_blocked(residual, block)), CLIP, 0.0, 6.0, y)
    expected = reference_conv(x, weight, stride, pads, dilation, (oh, ow))
    expected = np.clip(expected + bias[:, None, None] + residual, 0.0, 6.0)
    np.testing.assert_allclose(from_blocked(y.numpy()), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize(
    "batch, channels, size, kernel, stride, pads, dilation",
    [
        (2, 32, (9, 13), (3, 3), (1, 1), (1, 1), (1, 1)),
        (1, 16, (15, 17), (3, 3), (2, 2), (1, 1), (1, 1)),  # stride 2, odd sizes
        (1, 48, (8, 8), (3, 3), (2, 2), (0, 0), (1, 1)),  # no padding
        (1, 16, (11, 12), (3, 3), (1, 1), (2, 2), (2, 2)),  # dilated
        (1, 32, (10, 10), (5, 5), (1, 2), (2, 2), (1, 1)),  # 5x5, uneven strides
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
