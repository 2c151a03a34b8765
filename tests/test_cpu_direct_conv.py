"""The CPU library's direct conv2d kernel (`gimlet.cpu.conv2d_nchw_direct`: weights in blocks
of 8 or 16 output channels) against numpy and onnxruntime, and its dispatch.

The 8-channel blocks run the AVX2 instance, the 16-channel blocks the AVX-512 one (or, on a
CPU without AVX-512, the AVX2 instance on 16-lane vectors), so both are exercised here.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from onnx import helper
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx

from gimlet_tvm.errors import CompileError
from gimlet_tvm.relax_passes.dispatch_cpu_library import (
    ADD_TENSOR, ADD_VECTOR, CLIP, CONV2D_FUNC, DIRECT_CONV2D_FUNC, DIRECT_CONV_BLOCK_ENV, GELU, RELU,
    DispatchCPULibrary, direct_conv_block, pack_conv_weight)
from gimlet_tvm.runtime.extensions import load_extensions

from .test_cpu_library import onnx_model, packed_calls, rand, run_both

BLOCKS = [8, 16]


def clip_step(lo: float, hi: float) -> tuple:
    """A clip epilogue step as the dispatch passes it: the kind, then a float32 [lo, hi]."""
    return (CLIP, tvm.runtime.tensor(np.array([lo, hi], np.float32)))


def reference_conv(x: np.ndarray, w: np.ndarray, stride: tuple, pads: tuple, dilation: tuple,
                   out_hw: tuple) -> np.ndarray:
    """NCHW / OIHW conv2d in float64 numpy; pads (top, left); the output size sets the rest."""
    (sh, sw), (top, left), (dh, dw), (oh, ow) = stride, pads, dilation, out_hw
    kh, kw = w.shape[2:]
    rows, cols = (oh - 1) * sh + (kh - 1) * dh + 1, (ow - 1) * sw + (kw - 1) * dw + 1
    padded = np.zeros((*x.shape[:2], max(rows, top + x.shape[2]), max(cols, left + x.shape[3])))
    padded[:, :, top:top + x.shape[2], left:left + x.shape[3]] = x
    y = np.zeros((x.shape[0], w.shape[0], oh, ow))
    for i in range(kh):
        for j in range(kw):
            patch = padded[:, :, i * dh:i * dh + (oh - 1) * sh + 1:sh, j * dw:j * dw + (ow - 1) * sw + 1:sw]
            y += np.einsum("oc,nchw->nohw", w[:, :, i, j].astype(np.float64), patch)
    return y


def gelu(v: np.ndarray) -> np.ndarray:
    from scipy.special import erf  # pylint: disable=import-outside-toplevel
    return 0.5 * v * (1.0 + erf(v / np.sqrt(2.0)))


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize(
    "batch, in_c, size, out_c, kernel, stride, pads, bottom_right, dilation",
    [
        (1, 3, (17, 19), 5, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),  # fewer channels than a block
        (2, 7, (9, 23), 37, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1)),  # odd channels, stride 2
        (1, 16, (14, 14), 33, (1, 1), (1, 1), (0, 0), (0, 0), (1, 1)),  # 1x1
        (1, 3, (30, 30), 20, (7, 7), (2, 2), (3, 3), (3, 3), (1, 1)),  # ResNet stem
        (2, 5, (11, 13), 17, (3, 3), (1, 1), (2, 2), (2, 2), (2, 2)),  # dilated
        (2, 5, (11, 13), 17, (3, 3), (2, 2), (2, 2), (1, 2), (2, 2)),  # dilated, stride 2
        (2, 9, (10, 9), 20, (1, 1), (2, 2), (0, 0), (0, 0), (1, 1)),  # 1x1 stride 2: one phase read
        (1, 6, (12, 10), 24, (3, 2), (1, 2), (2, 0), (1, 1), (1, 1)),  # asymmetric, uneven strides
        (3, 64, (7, 7), 48, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),  # deep layer: row tiles of 7
        (1, 24, (14, 14), 40, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),  # row tiles of 14, odd block
        (2, 3, (9, 32), 16, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),  # one block: row tiles of 16
        (1, 5, (20, 64), 12, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1)),  # ... a part block, stride 2
        (2, 20, (16, 16), 40, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),  # row tiles of 8, odd block
        (1, 24, (9, 9), 32, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),  # 9 wide: grid tiles span rows
        (2, 20, (13, 11), 64, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),  # AVX-512: 4-block tiles
        (1, 40, (10, 10), 129, (1, 1), (1, 1), (0, 0), (0, 0), (1, 1)),  # ... not whole fours
        # padded copy of 3 planes big enough to be split between threads
        (1, 3, (120, 110), 8, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1)),
    ],
)
def test_direct_conv2d_against_numpy(block, batch, in_c, size, out_c, kernel, stride, pads,
                                     bottom_right, dilation) -> None:
    load_extensions()
    (h, w), (kh, kw) = size, kernel
    oh = (h + pads[0] + bottom_right[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + pads[1] + bottom_right[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    x, weight = rand(batch, in_c, h, w, seed=1), rand(out_c, in_c, kh, kw, seed=2)
    y = tvm.runtime.tensor(np.full((batch, out_c, oh, ow), np.nan, np.float32))
    tvm.get_global_func(DIRECT_CONV2D_FUNC)(
        tvm.runtime.tensor(x), tvm.runtime.tensor(pack_conv_weight(weight, block)),
        *stride, *pads, *dilation, y)
    expected = reference_conv(x, weight, stride, pads, dilation, (oh, ow))
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-4, atol=1e-4)


def epilogue_cases(batch: int, in_c: int, out_c: int, size: int) -> tuple:
    """Data, an OIHW 3x3 weight, their conv (stride 1, padding 1) and epilogues with the
    outputs they give: bias (a vector along channels) + ReLU, residual + clip."""
    x, weight = rand(batch, in_c, size, size, seed=3), rand(out_c, in_c, 3, 3, seed=4)
    bias, residual = rand(out_c, seed=5), rand(batch, out_c, size, size, seed=6)
    conv = reference_conv(x, weight, (1, 1), (1, 1), (1, 1), (size, size))
    cases = [
        ((ADD_VECTOR, tvm.runtime.tensor(bias), size * size, RELU), np.maximum(conv + bias[:, None, None], 0)),
        ((ADD_TENSOR, tvm.runtime.tensor(residual), *clip_step(-0.5, 2.0)), np.clip(conv + residual, -0.5, 2.0)),
    ]
    return x, weight, conv, cases


@pytest.mark.parametrize("block", BLOCKS)
def test_direct_conv2d_epilogues(block) -> None:
    """Bias (a vector along channels), residual, ReLU, clip and GELU, applied in order."""
    load_extensions()
    batch, out_c, size = 2, 19, 10
    x, weight, conv, cases = epilogue_cases(batch, 9, out_c, size)
    for steps, expected in [*cases, ((GELU,), gelu(conv))]:
        y = tvm.runtime.tensor(np.zeros((batch, out_c, size, size), np.float32))
        tvm.get_global_func(DIRECT_CONV2D_FUNC)(
            tvm.runtime.tensor(x), tvm.runtime.tensor(pack_conv_weight(weight, block)),
            1, 1, 1, 1, 1, 1, *steps, y)
        np.testing.assert_allclose(y.numpy(), expected, rtol=1e-4, atol=1e-4)


def test_direct_conv2d_rejects_a_bad_block() -> None:
    load_extensions()
    x, weight = rand(1, 2, 5, 5), rand(3, 2, 3, 3)
    y = tvm.runtime.tensor(np.zeros((1, 3, 3, 3), np.float32))
    with pytest.raises(Exception, match="channel block 4 is neither 8 nor 16"):
        tvm.get_global_func(DIRECT_CONV2D_FUNC)(
            tvm.runtime.tensor(x), tvm.runtime.tensor(pack_conv_weight(weight, 4)), 1, 1, 0, 0, 1, 1, y)


def _conv_residual_model(in_c: int, out_c: int, kernel: int, stride: int):
    """Conv (+bias) + residual Add + Relu, as ResNet's basic block ends."""
    pad = kernel // 2
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=[stride, stride], pads=[pad] * 4,
                         kernel_shape=[kernel, kernel]),
        helper.make_node("Add", ["c", "r"], ["s"]),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    weights = {"w": rand(out_c, in_c, kernel, kernel, seed=7), "b": rand(out_c, seed=8)}
    return onnx_model(nodes, [("x", ["batch", in_c, 15, 15]), ("r", ["batch", out_c, 8, 8])],
                      ("y", None), weights)


@pytest.mark.parametrize("block", ["8", "16"])
def test_direct_conv2d_in_a_model_against_onnxruntime(block, monkeypatch) -> None:
    """The pass sends a 3x3 conv with two or more channel blocks to the direct kernel, its
    bias, residual and ReLU fused; its weight is packed at build time (FoldConstant leaves a
    constant, no layout_transform call, in `main`)."""
    monkeypatch.setenv(DIRECT_CONV_BLOCK_ENV, block)
    model = _conv_residual_model(6, 35, 3, 2)
    mod = from_onnx(model, keep_params_in_input=False)
    assert packed_calls(mod) == [DIRECT_CONV2D_FUNC]
    lowered = tvm.transform.Sequential(
        [DispatchCPULibrary(), relax.transform.LegalizeOps(), relax.transform.FoldConstant()])(mod)
    main = lowered["main"].script()
    assert "call_tir" not in main and f'"{DIRECT_CONV2D_FUNC}", (x, metadata' in main
    for batch in (1, 3):
        inputs = {"x": rand(batch, 6, 15, 15, seed=batch), "r": rand(batch, 35, 8, 8, seed=9)}
        ours, reference = run_both(model, inputs)
        np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "cpu_block, in_c, out_c, kernel, block",
    [
        ("16", 6, 35, 3, 16),
        ("16", 6, 16, 3, 16),  # one block
        ("16", 6, 8, 3, 8),  # fewer channels than this CPU's block: the narrower one
        ("8", 6, 16, 3, 8),
        ("8", 6, 4, 3, 0),  # fewer channels than any block
        ("16", 3, 35, 1, 0),  # 3 multiply-adds per output
        ("16", 64, 128, 1, 0),  # 1x1: a GEMM, OpenBLAS's
        ("0", 6, 35, 3, 0),  # direct kernel turned off
    ],
)
def test_direct_conv2d_dispatch_rule(cpu_block, in_c, out_c, kernel, block, monkeypatch) -> None:
    """Where the rule sends a conv to the direct kernel, and with which channel block."""
    monkeypatch.setenv(DIRECT_CONV_BLOCK_ENV, cpu_block)
    mod = from_onnx(_conv_residual_model(in_c, out_c, kernel, 2), keep_params_in_input=False)
    assert packed_calls(mod) == [DIRECT_CONV2D_FUNC if block else CONV2D_FUNC]
    if block:
        packed = [b.value for b in DispatchCPULibrary()(mod)["main"].body.blocks[0].bindings
                  if isinstance(b.value, relax.Call) and b.value.op.name == "relax.layout_transform"]
        assert [tuple(int(d) for d in p.ty.shape) for p in packed] == [
            (-(-out_c // block), in_c, kernel, kernel, block)]


def test_direct_conv_block_override(monkeypatch) -> None:
    monkeypatch.delenv(DIRECT_CONV_BLOCK_ENV, raising=False)
    assert direct_conv_block() in (0, 8, 16)
    monkeypatch.setenv(DIRECT_CONV_BLOCK_ENV, "12")
    with pytest.raises(CompileError, match="GIMLET_CPU_CONV_BLOCK must be 0, 8 or 16"):
        direct_conv_block()
