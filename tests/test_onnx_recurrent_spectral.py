"""RNN/GRU/LSTM, Scan, DFT/STFT/MelWeightMatrix, Col2Im, DeformConv and Det converters on cases beyond the
conformance suite (run-time lengths and axes, masks, groups), compared with onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import gimlet_tvm

FLOAT = TensorProto.FLOAT
rng = np.random.default_rng(0)


def _model(nodes, feeds: dict, outputs: dict, initializers=(), opset=22) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for name, v in feeds.items()]
    outs = [helper.make_tensor_value_info(name, FLOAT, [None] * rank)
            for name, rank in outputs.items()]
    graph = helper.make_graph(nodes, "t", inputs, outs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def _check(model: onnx.ModelProto, feeds: dict, rtol=1e-4, atol=1e-5) -> None:
    ours = gimlet_tvm.build(model, "llvm").run(feeds)
    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    for name, want in zip([o.name for o in model.graph.output], session.run(None, feeds)):
        got = np.asarray(ours[name])
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def _normal(*shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("op,attrs", [
    ("RNN", {"direction": "bidirectional", "activations": ["Relu", "Tanh"]}),
    ("GRU", {"direction": "reverse", "linear_before_reset": 1, "clip": 0.7}),
    ("LSTM", {"direction": "bidirectional", "input_forget": 1}),
])
def test_recurrent_with_run_time_sequence_lens(op, attrs):
    """Per-batch lengths at run time: states hold and outputs are zero past each length."""
    gates, directions = {"RNN": 1, "GRU": 3, "LSTM": 4}[op], 1 + (attrs["direction"] == "bidirectional")
    steps, batch, size, hidden = 4, 3, 2, 3
    feeds = {"X": _normal(steps, batch, size), "W": _normal(directions, gates * hidden, size),
             "R": _normal(directions, gates * hidden, hidden),
             "B": _normal(directions, 2 * gates * hidden),
             "lens": np.array([4, 2, 1], np.int32), "h0": _normal(directions, batch, hidden)}
    names = ["X", "W", "R", "B", "lens", "h0"]
    outputs = {"Y": 4, "Y_h": 3}
    if op == "LSTM":
        feeds.update(c0=_normal(directions, batch, hidden), P=_normal(directions, 3 * hidden))
        names += ["c0", "P"]
        outputs["Y_c"] = 3
    node = helper.make_node(op, names, list(outputs), hidden_size=hidden, **attrs)
    _check(_model([node], feeds, outputs, opset=14), feeds)


def test_scan_axes_directions_and_outer_scope():
    """Scan-9+ with a non-zero, reversed scan input axis, a reversed output on axis 1 and a
    body that reads a value of the enclosing graph."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["a", "b"], ["p"]), helper.make_node("Mul", ["p", "w"], ["q"]),
         helper.make_node("Add", ["s", "q"], ["s_next"]), helper.make_node("Neg", ["s_next"], ["o"])],
        "body", [helper.make_tensor_value_info(n, FLOAT, [2]) for n in ("s", "a", "b")],
        [helper.make_tensor_value_info(n, FLOAT, [2]) for n in ("s_next", "o")])
    feeds = {"s0": _normal(2), "x": _normal(2, 3), "y": _normal(3, 2), "w0": _normal(2)}
    nodes = [helper.make_node("Abs", ["w0"], ["w"]),
             helper.make_node("Scan", ["s0", "x", "y"], ["s", "out"], num_scan_inputs=2, body=body,
                              scan_input_axes=[1, 0], scan_input_directions=[1, 0],
                              scan_output_axes=[1], scan_output_directions=[1])]
    _check(_model(nodes, feeds, {"s": 1, "out": 2}, opset=16), feeds)


@pytest.mark.parametrize("inverse,onesided,shape", [(0, 1, (2, 8, 3, 1)), (1, 1, (2, 5, 3, 2)),
                                                    (1, 0, (2, 7, 3, 2))])
def test_dft_with_run_time_axis(inverse, onesided, shape):
    """DFT-20 with the axis given at run time (onesided: the output shape chosen at run time)."""
    feeds = {"x": _normal(*shape), "axis": np.array(0, np.int64)}
    model = _model([helper.make_node("DFT", ["x", "", "axis"], ["y"], inverse=inverse,
                                     onesided=onesided)], feeds, {"y": 4}, opset=20)
    for axis in (1, -2, 0):
        _check(model, {"x": _normal(*shape), "axis": np.array(axis, np.int64)}, 1e-3, 1e-4)


@pytest.mark.parametrize("inverse,onesided", [(0, 1), (1, 1), (1, 0)])
def test_dft_with_run_time_length(inverse, onesided):
    """dft_length at run time, shorter and longer than the signal, against numpy's FFTs
    (onnxruntime's irfft differs from numpy and ONNX's reference when n truncates the bins)."""
    axis = numpy_helper.from_array(np.array(1, np.int64), "axis")
    x = _normal(2, 6, 3, 1 + inverse)
    model = _model([helper.make_node("DFT", ["x", "n", "axis"], ["y"], inverse=inverse,
                                     onesided=onesided)],
                   {"x": x, "n": np.array(4, np.int64)}, {"y": 4}, [axis], opset=20)
    compiled = gimlet_tvm.build(model, "llvm")
    signal = x[..., 0] + 1j * x[..., 1] if inverse else x[..., 0]
    for n in (4, 9):
        got = np.asarray(compiled.run({"x": x, "n": np.array(n, np.int64)})["y"])
        if inverse and onesided:
            want = np.fft.irfft(signal, n=n, axis=1)[..., None]
        else:
            spectrum = (np.fft.ifft if inverse else np.fft.rfft)(signal, n=n, axis=1)
            want = np.stack([spectrum.real, spectrum.imag], axis=-1)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_stft_with_window_and_constant_step():
    signal = _normal(2, 50, 1)
    step = numpy_helper.from_array(np.array(5, np.int64), "step")
    feeds = {"signal": signal, "window": _normal(9)}
    node = helper.make_node("STFT", ["signal", "step", "window"], ["y"], onesided=0)
    _check(_model([node], feeds, {"y": 4}, [step], opset=17), feeds, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("run_time", [False, True])
def test_col2im_padded_strided_dilated(run_time):
    image, block = np.array([7, 6], np.int64), np.array([3, 2], np.int64)
    attrs = dict(strides=[2, 1], pads=[1, 0, 2, 1], dilations=[1, 2])
    blocks = [(7 + 1 + 2 - 2 - 1) // 2 + 1, (6 + 0 + 1 - 2 - 1) // 1 + 1]
    feeds = {"x": _normal(2, 3 * 6, blocks[0] * blocks[1])}
    shapes = {"image": image, "block": block}
    if run_time:
        feeds.update(shapes)
    initializers = [] if run_time else [numpy_helper.from_array(v, k) for k, v in shapes.items()]
    node = helper.make_node("Col2Im", ["x", "image", "block"], ["y"], **attrs)
    _check(_model([node], feeds, {"y": 4}, initializers, opset=18), feeds)


def test_deform_conv_groups_mask_bias():
    feeds = {"X": _normal(2, 4, 7, 6), "W": _normal(6, 2, 3, 2), "O": 2 * _normal(2, 24, 4, 5),
             "B": _normal(6), "M": rng.random((2, 12, 4, 5)).astype(np.float32)}
    node = helper.make_node("DeformConv", ["X", "W", "O", "B", "M"], ["Y"], group=2,
                            offset_group=2, strides=[2, 1], dilations=[1, 2], pads=[1, 0, 2, 1],
                            kernel_shape=[3, 2])
    _check(_model([node], feeds, {"Y": 4}, opset=19), feeds)


def test_det_pivoting_singular_and_batched():
    x = np.stack([np.array([[0, 1, 2], [1, 0, 3], [4, 5, 0]], np.float32),
                  np.array([[1, 2, 3], [2, 4, 6], [0, 1, 1]], np.float32), _normal(3, 3)])
    model = _model([helper.make_node("Det", ["x"], ["y"])], {"x": x}, {"y": 1})
    got = np.asarray(gimlet_tvm.build(model, "llvm").run({"x": x})["y"])
    np.testing.assert_allclose(got, np.linalg.det(x.astype(np.float64)), rtol=1e-5, atol=1e-5)


def test_mel_weight_matrix_double_output():
    """Run-time parameters, float64 output, against ONNX's reference."""
    feeds = {"bins": np.array(10, np.int64), "length": np.array(64, np.int64),
             "rate": np.array(16000, np.int64), "low": np.array(20, np.float32),
             "high": np.array(7600, np.float32)}
    node = helper.make_node("MelWeightMatrix", list(feeds), ["y"],
                            output_datatype=TensorProto.DOUBLE)
    model = _model([node], feeds, {"y": 2}, opset=17)
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    got = np.asarray(gimlet_tvm.build(model, "llvm").run(feeds)["y"])
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
