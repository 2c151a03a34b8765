"""The CPU library's Winograd conv2d (`gimlet.cpu.conv2d_nchw_winograd`, F(2x2, 3x3) and
F(4x4, 3x3), on NCHW and on channel-blocked NCHW{B}c data) against numpy and onnxruntime, and
the dispatch rule that picks it.

Tolerance: Winograd adds rounding in the transforms, more with larger tiles (F(4x4)'s B^T and
A^T hold 4, 5 and 8, its G 1/6 and 1/24). With standard-normal data and weights the largest
error, relative to the largest output, measured 1e-7 to 4e-7 for F(2x2) and 1e-6 to 8e-6 for
F(4x4) at 3 to 65 input channels (it grows with the channels summed); the tests allow about
5x that: `TOLERANCE[tile]` times the largest output, as an absolute bound on every element
(relative bounds per element would fail on outputs near zero, which carry the same absolute
error as the others).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from onnx import helper
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx

from gimlet_tvm.errors import CompileError
from gimlet_tvm.relax_passes.dispatch_cpu_library import (
    ADD_BLOCKED_VECTOR, ADD_TENSOR, CONV2D_FUNC, DIRECT_CONV2D_FUNC,
    DIRECT_CONV_BLOCK_ENV, GELU, RELU, WINOGRAD_CONV2D_FUNC, WINOGRAD_ENV, DispatchCPULibrary,
    winograd_override, winograd_tile_for, winograd_weight)
from gimlet_tvm.runtime.extensions import load_extensions

from .test_cpu_blocked_conv import to_blocked
from .test_cpu_direct_conv import clip_step, epilogue_cases, reference_conv
from .test_cpu_library import onnx_model, packed_calls, rand, run_both

TILES = [2, 4]
TOLERANCE = {2: 2e-6, 4: 4e-5}


def winograd(x: np.ndarray, weight: np.ndarray, tile: int, pads: tuple, out_hw: tuple,
             epilogue: tuple = ()) -> np.ndarray:
    """The library's Winograd conv2d (stride 1, pads (top, left)) of x with `weight` (OIHW)."""
    y = tvm.runtime.tensor(np.full((x.shape[0], weight.shape[0], *out_hw), np.nan, np.float32))
    tvm.get_global_func(WINOGRAD_CONV2D_FUNC)(
        tvm.runtime.tensor(x), tvm.runtime.tensor(winograd_weight(weight, tile)), 1, 1, *pads, 1, 1,
        *epilogue, y)
    return y.numpy()


def assert_close(actual: np.ndarray, expected: np.ndarray, tile: int, conv: np.ndarray | None = None) -> None:
    """Within the tile's tolerance of the largest convolution output (`conv`, before an epilogue
    that clips; else `expected`)."""
    scale = np.abs(expected if conv is None else conv).max()
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE[tile] * scale)


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize(
    "batch, in_c, size, out_c, pads, out_hw",
    [
        (1, 3, (7, 7), 5, (1, 1), (7, 7)),  # one tile and a cut one per row
        (2, 17, (9, 14), 65, (1, 1), (9, 14)),  # batch 2, odd channels
        (1, 65, (17, 17), 17, (1, 1), (17, 17)),
        (1, 8, (14, 9), 4, (0, 0), (12, 7)),  # no padding
        (1, 5, (9, 17), 3, (1, 0), (8, 15)),  # top and left padding only (bottom, right: 0)
        (2, 6, (7, 9), 7, (0, 1), (6, 9)),  # asymmetric: left and right padding, no top
    ],
)
def test_winograd_conv2d_against_numpy(tile, batch, in_c, size, out_c, pads, out_hw) -> None:
    load_extensions()
    x, weight = rand(batch, in_c, *size, seed=1), rand(out_c, in_c, 3, 3, seed=2)
    expected = reference_conv(x, weight, (1, 1), pads, (1, 1), out_hw)
    assert_close(winograd(x, weight, tile, pads, out_hw), expected, tile)


@pytest.mark.parametrize("tile", TILES)
def test_winograd_conv2d_epilogues(tile) -> None:
    """Bias (a vector along channels) + ReLU, and residual + clip, applied in order."""
    load_extensions()
    size = 9
    x, weight, conv, cases = epilogue_cases(2, 9, 19, size)
    for steps, expected in cases:
        assert_close(winograd(x, weight, tile, (1, 1), (size, size), steps), expected, tile, conv)


def blocked_winograd(x: np.ndarray, weight: np.ndarray, tile: int, block: int, pads: tuple,
                     out_hw: tuple, epilogue: tuple = ()) -> np.ndarray:
    """The library's Winograd conv2d on NCHW{block}c data (`x` NCHW, blocked here), its
    output back in NCHW."""
    n, out_c = x.shape[0], weight.shape[0]
    y = tvm.runtime.tensor(np.full((n, out_c // block, *out_hw, block), np.nan, np.float32))
    tvm.get_global_func(WINOGRAD_CONV2D_FUNC)(
        tvm.runtime.tensor(to_blocked(x, block)), tvm.runtime.tensor(winograd_weight(weight, tile, block)),
        1, 1, *pads, 1, 1, *epilogue, y)
    blocked = y.numpy()
    return blocked.transpose(0, 1, 4, 2, 3).reshape(n, out_c, *out_hw)


@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize(
    "batch, in_c, size, out_c, pads, out_hw",
    [
        (1, 16, (7, 7), 32, (1, 1), (7, 7)),  # a whole tile and a cut one per row and column
        (2, 32, (9, 14), 16, (1, 1), (9, 14)),  # batch 2, fewer output than input channels
        (1, 16, (14, 9), 48, (0, 0), (12, 7)),  # no padding
        (1, 48, (17, 17), 32, (1, 0), (16, 15)),  # top and left padding only
        (2, 16, (6, 9), 16, (0, 1), (4, 9)),  # left and right padding, one tile row (F(4x4))
    ],
)
def test_blocked_winograd_conv2d_against_numpy(block, tile, batch, in_c, size, out_c, pads, out_hw) -> None:
    """On NCHW{B}c data and output, with a blocked bias + ReLU, a residual + clip (both taken
    on vectors) and GELU (taken on the unit's rows afterwards)."""
    load_extensions()
    x, weight = rand(batch, in_c, *size, seed=11), rand(out_c, in_c, 3, 3, seed=12)
    bias, residual = rand(out_c, seed=13), rand(batch, out_c, *out_hw, seed=14)
    conv = reference_conv(x, weight, (1, 1), pads, (1, 1), out_hw)
    gelu = np.vectorize(lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2))))
    cases = [
        ((), conv),
        ((ADD_BLOCKED_VECTOR, tvm.runtime.tensor(bias), math.prod(out_hw) * block, block, RELU),
         np.maximum(conv + bias[:, None, None], 0)),
        ((ADD_TENSOR, tvm.runtime.tensor(to_blocked(residual, block)), *clip_step(-0.5, 2.0)),
         np.clip(conv + residual, -0.5, 2.0)),
        ((GELU,), gelu(conv.astype(np.float64)).astype(np.float32)),
    ]
    for steps, expected in cases:
        actual = blocked_winograd(x, weight, tile, block, pads, out_hw, steps)
        assert_close(actual, expected, tile, conv)


def test_winograd_conv2d_rejects_bad_input() -> None:
    load_extensions()
    x, weight = tvm.runtime.tensor(rand(1, 2, 6, 6)), rand(3, 2, 3, 3)
    y = tvm.runtime.tensor(np.zeros((1, 3, 6, 6), np.float32))
    func = tvm.get_global_func(WINOGRAD_CONV2D_FUNC)
    with pytest.raises(Exception, match="25 transform points is neither 16"):
        func(x, tvm.runtime.tensor(rand(25, 3, 2)), 1, 1, 1, 1, 1, 1, y)
    with pytest.raises(Exception, match="stride and dilation must be 1"):
        func(x, tvm.runtime.tensor(winograd_weight(weight, 2)), 2, 2, 1, 1, 1, 1, y)
    with pytest.raises(Exception, match="shapes differ"):
        func(x, tvm.runtime.tensor(winograd_weight(rand(3, 4, 3, 3), 2)), 1, 1, 1, 1, 1, 1, y)
    with pytest.raises(CompileError, match="no Winograd transform for tile 3"):
        winograd_weight(weight, 3)
    blocked = tvm.runtime.tensor(rand(1, 1, 6, 6, 16))
    blocked_out = tvm.runtime.tensor(np.zeros((1, 2, 6, 6, 8), np.float32))
    blocked_weight = tvm.runtime.tensor(winograd_weight(rand(16, 16, 3, 3), 2, 16))
    with pytest.raises(Exception, match="must be 4-D, 4-D and 3-D .NCHW. or 5-D, 5-D and 4-D"):
        func(blocked, tvm.runtime.tensor(winograd_weight(rand(16, 16, 3, 3), 2)), 1, 1, 1, 1, 1, 1,
             tvm.runtime.tensor(np.zeros((1, 1, 6, 6, 16), np.float32)))
    with pytest.raises(Exception, match="one block of 8 or 16 channels, not 16 and 8"):
        func(blocked, blocked_weight, 1, 1, 1, 1, 1, 1, blocked_out)
    with pytest.raises(Exception, match="shapes differ"):
        func(blocked, tvm.runtime.tensor(winograd_weight(rand(32, 16, 3, 3), 2, 16)), 1, 1, 1, 1,
             1, 1, tvm.runtime.tensor(np.zeros((1, 1, 6, 6, 16), np.float32)))


def _conv_model(in_c: int, out_c: int, size: int, stride: int = 1, dilation: int = 1, groups: int = 1):
    """Conv 3x3 (+bias, padding 1) + residual Add + Relu, as ResNet's basic block ends."""
    out = (size + 2 - 2 * dilation - 1) // stride + 1
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=[stride] * 2, pads=[1] * 4,
                         dilations=[dilation] * 2, group=groups, kernel_shape=[3, 3]),
        helper.make_node("Add", ["c", "r"], ["s"]),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    weights = {"w": rand(out_c, in_c // groups, 3, 3, seed=7), "b": rand(out_c, seed=8)}
    return onnx_model(nodes, [("x", ["batch", in_c, size, size]), ("r", ["batch", out_c, out, out])],
                      ("y", None), weights)


@pytest.mark.parametrize("tile", ["2", "4"])
def test_winograd_conv2d_in_a_model_against_onnxruntime(tile, monkeypatch) -> None:
    """With `$GIMLET_CPU_WINOGRAD` set, the pass sends a 3x3 stride-1 conv to the Winograd
    kernel with its bias, residual and ReLU fused, and its weight transformed at build time (a
    constant in `main`, no transform op)."""
    monkeypatch.setenv(WINOGRAD_ENV, tile)
    model = _conv_model(6, 35, 15)
    mod = from_onnx(model, keep_params_in_input=False)
    assert packed_calls(mod) == [WINOGRAD_CONV2D_FUNC]
    lowered = tvm.transform.Sequential(
        [DispatchCPULibrary(), relax.transform.LegalizeOps(), relax.transform.FoldConstant()])(mod)
    main = lowered["main"].script()
    assert "call_tir" not in main and f'"{WINOGRAD_CONV2D_FUNC}", (x, metadata' in main
    for batch in (1, 3):
        inputs = {"x": rand(batch, 6, 15, 15, seed=batch), "r": rand(batch, 35, 15, 15, seed=9)}
        ours, reference = run_both(model, inputs)
        assert_close(ours, reference, int(tile))


@pytest.mark.parametrize(
    "winograd_env, in_c, out_c, size, stride, dilation, groups, expected",
    [
        ("", 64, 64, 28, 1, 1, 1, WINOGRAD_CONV2D_FUNC),  # ResNet's early layers
        ("", 32, 32, 28, 1, 1, 1, WINOGRAD_CONV2D_FUNC),
        ("", 64, 64, 14, 1, 1, 1, WINOGRAD_CONV2D_FUNC),
        ("", 16, 16, 28, 1, 1, 1, DIRECT_CONV2D_FUNC),  # too few channels
        ("", 256, 256, 14, 1, 1, 1, DIRECT_CONV2D_FUNC),  # weight too large for its tiles
        ("", 128, 128, 7, 1, 1, 1, DIRECT_CONV2D_FUNC),
        ("0", 64, 64, 28, 1, 1, 1, DIRECT_CONV2D_FUNC),  # turned off
        ("4", 64, 64, 28, 2, 1, 1, DIRECT_CONV2D_FUNC),  # stride 2
        ("4", 64, 64, 28, 1, 2, 1, DIRECT_CONV2D_FUNC),  # dilation 2
        ("4", 64, 64, 28, 1, 1, 2, CONV2D_FUNC),  # groups 2
    ],
)
def test_winograd_dispatch_rule(winograd_env, in_c, out_c, size, stride, dilation, groups, expected,
                                monkeypatch) -> None:
    monkeypatch.setenv(DIRECT_CONV_BLOCK_ENV, "16")
    monkeypatch.setenv(WINOGRAD_ENV, winograd_env)
    mod = from_onnx(_conv_model(in_c, out_c, size, stride, dilation, groups), keep_params_in_input=False)
    assert packed_calls(mod) == [expected]


def test_winograd_override(monkeypatch) -> None:
    monkeypatch.delenv(WINOGRAD_ENV, raising=False)
    assert winograd_override() is None
    assert winograd_tile_for(64, 64, (3, 3), (56, 56), 16) == 4
    assert winograd_tile_for(64, 64, (3, 3), (56, 56), 0) == 0  # no direct kernel: not measured
    assert winograd_tile_for(64, 64, (3, 3), (8, 8), 16) == 4  # 144 KiB of weight a tile
    assert winograd_tile_for(32, 128, (3, 3), (7, 7), 16) == 4  # DenseNet's growth convs
    assert winograd_tile_for(128, 128, (3, 3), (7, 7), 16) == 0  # 576 KiB a tile
    assert winograd_tile_for(16, 64, (3, 3), (56, 56), 16) == 0  # too few channels
    assert winograd_tile_for(256, 256, (3, 3), (14, 14), 8) == 2  # AVX2: F(2x2)
    assert winograd_tile_for(256, 256, (3, 3), (14, 14), 16) == 0  # AVX-512: direct row tiles
    monkeypatch.setenv(WINOGRAD_ENV, "2")
    assert winograd_override() == 2
    monkeypatch.setenv(WINOGRAD_ENV, "3")
    with pytest.raises(CompileError, match="GIMLET_CPU_WINOGRAD must be 0, 2 or 4"):
        winograd_override()
