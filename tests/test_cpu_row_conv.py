"""The CPU library's row-vectorized conv2d kernel (`gimlet.cpu.conv2d_nchw_rows`: vectors of
output pixels along a row, for convs with few input channels) against numpy and onnxruntime,
and its dispatch.

Asking for 8 lanes runs the AVX2 instance, 16 lanes the AVX-512 one (on a CPU without AVX-512,
the AVX2 one again), so both are exercised here.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from onnx import helper
from tvm.relax.frontend.onnx import from_onnx

from gimlet_tvm.relax_passes.dispatch_cpu_library import (
    CONV2D_FUNC, DIRECT_CONV2D_FUNC, DIRECT_CONV_BLOCK_ENV, ROW_CONV2D_FUNC, row_conv_for)
from gimlet_tvm.runtime.extensions import load_extensions

from .test_cpu_direct_conv import ADD_TENSOR, ADD_VECTOR, RELU, clip_step, reference_conv
from .test_cpu_library import onnx_model, packed_calls, rand, run_both

LANES = [8, 16]


def run_rows(x: np.ndarray, weight: np.ndarray, stride, pads, dilation, out_hw, lanes: int,
             steps: list = ()) -> np.ndarray:
    """The kernel's output (NaN-filled first, so an unwritten element shows)."""
    load_extensions()
    y = tvm.runtime.tensor(np.full((x.shape[0], weight.shape[0], *out_hw), np.nan, np.float32))
    tvm.get_global_func(ROW_CONV2D_FUNC)(
        tvm.runtime.tensor(x), tvm.runtime.tensor(weight), *stride, *pads, *dilation, lanes,
        *steps, y)
    return y.numpy()


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize(
    "batch, in_c, size, out_c, kernel, stride, pads, bottom_right, dilation",
    [
        (2, 3, (64, 64), 16, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),  # resnet_cnn's stem
        (1, 3, (33, 31), 16, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1)),  # MobileNet's stem, odd size
        (1, 3, (30, 30), 20, (7, 7), (2, 2), (3, 3), (3, 3), (1, 1)),  # ResNet's stem, 20 channels
        (2, 1, (17, 19), 5, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),  # fewer channels than a tile
        (1, 2, (15, 13), 37, (3, 3), (3, 3), (0, 2), (2, 0), (2, 2)),  # stride 3, dilated, uneven pads
        (1, 3, (9, 40), 9, (3, 2), (1, 2), (2, 0), (1, 1), (1, 1)),  # asymmetric kernel and strides
        (2, 2, (6, 5), 3, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),  # a row shorter than a vector
        (1, 16, (12, 12), 24, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),  # a longer reduction
    ],
)
def test_row_conv2d_against_numpy(lanes, batch, in_c, size, out_c, kernel, stride, pads,
                                  bottom_right, dilation) -> None:
    (h, w), (kh, kw) = size, kernel
    oh = (h + pads[0] + bottom_right[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + pads[1] + bottom_right[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    x, weight = rand(batch, in_c, h, w, seed=1), rand(out_c, in_c, kh, kw, seed=2)
    y = run_rows(x, weight, stride, pads, dilation, (oh, ow), lanes)
    np.testing.assert_allclose(y, reference_conv(x, weight, stride, pads, dilation, (oh, ow)),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lanes", LANES)
def test_row_conv2d_epilogues(lanes) -> None:
    """Bias + ReLU, residual + clip: applied to the stored channels only (19 is no multiple of
    a tile's channels)."""
    batch, in_c, out_c, size = 2, 3, 19, 21
    x, weight = rand(batch, in_c, size, size, seed=3), rand(out_c, in_c, 3, 3, seed=4)
    bias, residual = rand(out_c, seed=5), rand(batch, out_c, 11, 11, seed=6)
    conv = reference_conv(x, weight, (2, 2), (1, 1), (1, 1), (11, 11))
    cases = [
        ([ADD_VECTOR, tvm.runtime.tensor(bias), 11 * 11, RELU], np.maximum(conv + bias[:, None, None], 0)),
        ([ADD_TENSOR, tvm.runtime.tensor(residual), *clip_step(0.0, 6.0)], np.clip(conv + residual, 0.0, 6.0)),
    ]
    for steps, expected in cases:
        y = run_rows(x, weight, (2, 2), (1, 1), (1, 1), (11, 11), lanes, steps)
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)


def test_row_conv2d_rejects_other_lanes() -> None:
    x, weight = rand(1, 2, 5, 5), rand(3, 2, 3, 3)
    with pytest.raises(Exception, match="conv2d_nchw_rows: 4 lanes"):
        run_rows(x, weight, (1, 1), (0, 0), (1, 1), (3, 3), 4)


def _stem_model(in_c: int, kernel: int, stride: int, clip: bool) -> object:
    """Conv (+bias) + Relu or Clip(0, 6), as a network's stem."""
    pad = kernel // 2
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=[stride, stride],
                              pads=[pad] * 4, kernel_shape=[kernel, kernel])]
    weights = {"w": rand(16, in_c, kernel, kernel, seed=7), "b": rand(16, seed=8)}
    if clip:
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"]))
        weights |= {"lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32)}
    else:
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    return onnx_model(nodes, [("x", ["batch", in_c, 29, 29])], ("y", None), weights)


@pytest.mark.parametrize("cpu_block", ["8", "16"])
@pytest.mark.parametrize("stride, clip", [(1, False), (2, True)])
def test_row_conv2d_in_a_model_against_onnxruntime(cpu_block, stride, clip, monkeypatch) -> None:
    """A 3-channel 3x3 stem goes to the row kernel, its bias and ReLU or ReLU6 fused."""
    monkeypatch.setenv(DIRECT_CONV_BLOCK_ENV, cpu_block)
    model = _stem_model(3, 3, stride, clip)
    assert packed_calls(from_onnx(model, keep_params_in_input=False)) == [ROW_CONV2D_FUNC]
    for batch in (1, 3):
        ours, reference = run_both(model, {"x": rand(batch, 3, 29, 29, seed=batch)})
        np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "cpu_block, in_c, kernel, func",
    [
        ("16", 3, 3, ROW_CONV2D_FUNC),  # 27 multiply-adds per output
        ("8", 3, 3, ROW_CONV2D_FUNC),
        ("16", 3, 1, CONV2D_FUNC),  # 1x1: a GEMM
        ("16", 4, 3, DIRECT_CONV2D_FUNC),  # 36 multiply-adds: the direct kernel's
        ("16", 3, 7, DIRECT_CONV2D_FUNC),  # ResNet's 7x7 stem: 147
        ("0", 3, 3, CONV2D_FUNC),  # direct kernels turned off
    ],
)
def test_row_conv2d_dispatch_rule(cpu_block, in_c, kernel, func, monkeypatch) -> None:
    monkeypatch.setenv(DIRECT_CONV_BLOCK_ENV, cpu_block)
    mod = from_onnx(_stem_model(in_c, kernel, 2, False), keep_params_in_input=False)
    assert packed_calls(mod) == [func]
    assert row_conv_for(in_c, (kernel, kernel), int(cpu_block)) == (func == ROW_CONV2D_FUNC)
