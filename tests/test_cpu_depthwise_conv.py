"""The CPU library's depthwise conv2d kernel (`gimlet.cpu.conv2d_nchw_depthwise`: vectors of
output pixels along a row, one input channel per output channel) against numpy and
onnxruntime, and its dispatch (by default for inputs at least 112 wide, where it beat the
generated TIR; `$GIMLET_CPU_DEPTHWISE=1` forces it here).

Asking for 8 lanes runs the AVX2 instance, 16 lanes the AVX-512 one (on a CPU without AVX-512,
the AVX2 one again), so both are exercised here; 3x3 and 5x5 kernels run unrolled instances,
other sizes the generic one.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from onnx import helper
from tvm.relax.frontend.onnx import from_onnx

from gimlet_tvm.errors import CompileError
from gimlet_tvm.relax_passes.dispatch_cpu_library import (
    DEPTHWISE_CONV2D_FUNC, DEPTHWISE_ENV, DIRECT_CONV_BLOCK_ENV, depthwise_conv_for,
    depthwise_kernel_wanted)
from gimlet_tvm.runtime.extensions import load_extensions

from .test_cpu_direct_conv import ADD_TENSOR, ADD_VECTOR, RELU, clip_step
from .test_cpu_library import onnx_model, packed_calls, rand, run_both

LANES = [8, 16]


def reference_depthwise(x: np.ndarray, w: np.ndarray, stride: tuple, pads: tuple, dilation: tuple,
                        out_hw: tuple) -> np.ndarray:
    """Depthwise NCHW conv2d (weight [O, 1, KH, KW], output channel o reading input channel
    o // (O // C)) in float64 numpy; pads (top, left); the output size sets the rest."""
    (sh, sw), (top, left), (dh, dw), (oh, ow) = stride, pads, dilation, out_hw
    kh, kw = w.shape[2:]
    rows, cols = (oh - 1) * sh + (kh - 1) * dh + 1, (ow - 1) * sw + (kw - 1) * dw + 1
    padded = np.zeros((*x.shape[:2], max(rows, top + x.shape[2]), max(cols, left + x.shape[3])))
    padded[:, :, top:top + x.shape[2], left:left + x.shape[3]] = x
    padded = np.repeat(padded, w.shape[0] // x.shape[1], axis=1)
    y = np.zeros((x.shape[0], w.shape[0], oh, ow))
    for i in range(kh):
        for j in range(kw):
            patch = padded[:, :, i * dh:i * dh + (oh - 1) * sh + 1:sh, j * dw:j * dw + (ow - 1) * sw + 1:sw]
            y += w[:, 0, i, j].astype(np.float64)[None, :, None, None] * patch
    return y


def run_depthwise(x: np.ndarray, weight: np.ndarray, stride, pads, dilation, out_hw, lanes: int,
                  steps: list = ()) -> np.ndarray:
    """The kernel's output (NaN-filled first, so an unwritten element shows)."""
    load_extensions()
    y = tvm.runtime.tensor(np.full((x.shape[0], weight.shape[0], *out_hw), np.nan, np.float32))
    tvm.get_global_func(DEPTHWISE_CONV2D_FUNC)(
        tvm.runtime.tensor(x), tvm.runtime.tensor(weight), *stride, *pads, *dilation, lanes,
        *steps, y)
    return y.numpy()


def _out_size(size, kernel, stride, pads, bottom_right, dilation) -> tuple[int, int]:
    return tuple((n + p + q - d * (k - 1) - 1) // s + 1
                 for n, k, s, p, q, d in zip(size, kernel, stride, pads, bottom_right, dilation))


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize(
    "batch, in_c, size, out_c, kernel, stride, pads, bottom_right, dilation",
    [
        (1, 32, (16, 16), 32, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),  # MobileNet's, one vector wide
        (2, 17, (17, 17), 17, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1)),  # odd channels and size, stride 2
        (1, 3, (5, 5), 3, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),  # a row shorter than a vector
        (1, 5, (33, 33), 5, (5, 5), (1, 1), (2, 2), (2, 2), (1, 1)),  # 5x5, rows of 2 vectors + 1
        (2, 6, (34, 36), 6, (5, 5), (2, 2), (2, 2), (2, 2), (1, 1)),  # 5x5 stride 2
        (1, 4, (20, 19), 4, (3, 3), (1, 1), (2, 2), (2, 2), (2, 2)),  # dilated
        (1, 7, (13, 70), 7, (3, 3), (2, 1), (0, 2), (1, 0), (1, 1)),  # uneven pads and strides
        (1, 9, (15, 11), 9, (3, 3), (1, 1), (0, 0), (0, 0), (1, 1)),  # no padding
        (1, 4, (12, 21), 8, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),  # channel multiplier 2
        (1, 6, (9, 18), 6, (2, 7), (1, 3), (1, 3), (0, 3), (1, 1)),  # generic taps, stride 3
        (2, 96, (7, 7), 96, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),  # deep layer: many planes
        (1, 2, (80, 80), 2, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),  # several row blocks per plane
    ],
)
def test_depthwise_conv2d_against_numpy(lanes, batch, in_c, size, out_c, kernel, stride, pads,
                                        bottom_right, dilation) -> None:
    out_hw = _out_size(size, kernel, stride, pads, bottom_right, dilation)
    x, weight = rand(batch, in_c, *size, seed=1), rand(out_c, 1, *kernel, seed=2)
    y = run_depthwise(x, weight, stride, pads, dilation, out_hw, lanes)
    np.testing.assert_allclose(y, reference_depthwise(x, weight, stride, pads, dilation, out_hw),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lanes", LANES)
def test_depthwise_conv2d_epilogues(lanes) -> None:
    """Bias + ReLU, residual + clip (ReLU6), on every row block of every channel."""
    batch, channels, size = 2, 17, 33
    x, weight = rand(batch, channels, size, size, seed=3), rand(channels, 1, 3, 3, seed=4)
    bias, residual = rand(channels, seed=5), rand(batch, channels, 17, 17, seed=6)
    conv = reference_depthwise(x, weight, (2, 2), (1, 1), (1, 1), (17, 17))
    cases = [
        ([ADD_VECTOR, tvm.runtime.tensor(bias), 17 * 17, RELU], np.maximum(conv + bias[:, None, None], 0)),
        ([ADD_TENSOR, tvm.runtime.tensor(residual), *clip_step(0.0, 6.0)], np.clip(conv + residual, 0.0, 6.0)),
    ]
    for steps, expected in cases:
        y = run_depthwise(x, weight, (2, 2), (1, 1), (1, 1), (17, 17), lanes, steps)
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "weight_shape, lanes, message",
    [
        ((3, 1, 3, 3), 4, "conv2d_nchw_depthwise: 4 lanes"),
        ((3, 2, 3, 3), 16, "conv2d_nchw_depthwise: shapes differ"),  # not one input channel each
        ((5, 1, 3, 3), 16, "conv2d_nchw_depthwise: shapes differ"),  # 5 outputs from 2 channels
    ],
)
def test_depthwise_conv2d_rejects_bad_input(weight_shape, lanes, message) -> None:
    x = rand(1, 2, 5, 5)
    with pytest.raises(Exception, match=message):
        run_depthwise(x, rand(*weight_shape), (1, 1), (0, 0), (1, 1), (3, 3), lanes)


def _block_model(channels: int, size: int, kernel: int, stride: int, pads: list[int],
                 dilation: int, residual: bool) -> object:
    """A MobileNet block's depthwise part: Conv (groups = channels, + bias), Clip(0, 6), and
    an Add of the block's input where the shapes allow."""
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], group=channels, strides=[stride, stride],
                         pads=pads, kernel_shape=[kernel, kernel], dilations=[dilation, dilation]),
        helper.make_node("Clip", ["c", "lo", "hi"], ["r" if residual else "y"]),
    ]
    if residual:
        nodes.append(helper.make_node("Add", ["r", "x"], ["y"]))
    weights = {"w": rand(channels, 1, kernel, kernel, seed=7), "b": rand(channels, seed=8),
               "lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32)}
    return onnx_model(nodes, [("x", ["batch", channels, size, size])], ("y", None), weights)


@pytest.mark.parametrize("cpu_block", ["8", "16"])
@pytest.mark.parametrize(
    "channels, size, kernel, stride, pads, dilation, residual",
    [
        (17, 17, 3, 1, [1, 1, 1, 1], 1, True),
        (32, 16, 3, 2, [1, 1, 1, 1], 1, False),
        (3, 33, 5, 2, [2, 1, 0, 2], 1, False),  # asymmetric padding
        (5, 20, 3, 1, [2, 2, 2, 2], 2, True),  # dilated, same size
    ],
)
def test_depthwise_conv2d_in_a_model_against_onnxruntime(cpu_block, channels, size, kernel, stride,
                                                         pads, dilation, residual, monkeypatch) -> None:
    """Asked for, depthwise convs go to the depthwise kernel, their bias, ReLU6 and residual
    add fused."""
    monkeypatch.setenv(DIRECT_CONV_BLOCK_ENV, cpu_block)
    monkeypatch.setenv(DEPTHWISE_ENV, "1")
    model = _block_model(channels, size, kernel, stride, pads, dilation, residual)
    assert packed_calls(from_onnx(model, keep_params_in_input=False)) == [DEPTHWISE_CONV2D_FUNC]
    for batch in (1, 2):
        ours, reference = run_both(model, {"x": rand(batch, channels, size, size, seed=batch)})
        np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "cpu_block, wanted, size, expected",
    [
        ("16", "", 112, [DEPTHWISE_CONV2D_FUNC]),  # the default: wide inputs
        ("8", "", 112, [DEPTHWISE_CONV2D_FUNC]),
        ("16", "", 12, []),  # the default: narrower ones stay in TIR, where they ran faster
        ("16", "1", 12, [DEPTHWISE_CONV2D_FUNC]),
        ("16", "0", 112, []),
        ("0", "1", 12, []),  # no AVX2 (or direct kernels off)
        ("0", "", 112, []),
    ],
)
def test_depthwise_conv2d_dispatch_rule(cpu_block, wanted, size, expected, monkeypatch) -> None:
    """The depthwise kernel runs on wide inputs or when asked for, and only on a CPU with AVX2;
    the model matches onnxruntime either way."""
    monkeypatch.setenv(DIRECT_CONV_BLOCK_ENV, cpu_block)
    monkeypatch.setenv(DEPTHWISE_ENV, wanted)
    model = _block_model(8, size, 3, 1, [1, 1, 1, 1], 1, True)
    assert packed_calls(from_onnx(model, keep_params_in_input=False)) == expected
    assert depthwise_conv_for(8, 8, size, int(cpu_block), depthwise_kernel_wanted()) == bool(expected)
    ours, reference = run_both(model, {"x": rand(2, 8, size, size, seed=9)})
    np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)


def test_depthwise_env_rejects_other_values(monkeypatch) -> None:
    monkeypatch.setenv(DEPTHWISE_ENV, "yes")
    with pytest.raises(CompileError, match="GIMLET_CPU_DEPTHWISE must be 0 or 1"):
        depthwise_kernel_wanted()
