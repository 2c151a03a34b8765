"""Edge cases of gimlet_tvm.onnx_ops converters, each compared against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

import gimlet_tvm
from gimlet_tvm.errors import ModelImportError


def _model(nodes, inputs, outputs, initializers=(), opset=23) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "t", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _check_against_onnxruntime(model: onnx.ModelProto, feeds: dict, rtol=1e-5, atol=1e-6):
    ours = gimlet_tvm.build(model, "llvm").run(feeds)
    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    for name, want in zip(names, session.run(None, feeds)):
        np.testing.assert_allclose(ours[name], want, rtol=rtol, atol=atol)
        assert ours[name].shape == want.shape and ours[name].dtype == want.dtype


@pytest.mark.parametrize("op,fill", [("ReduceMax", -np.inf), ("ReduceMin", np.inf)])
def test_reduce_extremes_of_infinite_rows(op, fill):
    """A row of all -inf (max) / +inf (min) reduces to -inf / +inf, not the finite limit."""
    x = np.array([[fill] * 3, [1.0, fill, 2.0]], np.float32)
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    model = _model([helper.make_node(op, ["x", "axes"], ["y"], keepdims=1)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1])], [axes], 18)
    _check_against_onnxruntime(model, {"x": x})


def test_reduce_runtime_axes_are_refused():
    model = _model([helper.make_node("ReduceSum", ["x", "axes"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                    helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])], opset=13)
    with pytest.raises(ModelImportError, match="unsupported: ReduceSum with axes given at run"):
        gimlet_tvm.build(model, "llvm")


def test_shape_arithmetic_folds_into_reshape():
    """Shape -> Gather -> Concat -> Reshape (as in expanded functions) imports and runs."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["batch"], axis=0),
        helper.make_node("Concat", ["batch", "minus_one"], ["new_shape"], axis=0),
        helper.make_node("Reshape", ["x", "new_shape"], ["y"]),
        helper.make_node("Constant", [], ["c"], value_floats=[0.5]),
        helper.make_node("Mul", ["y", "c"], ["z"]),
    ]
    inits = [helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
             helper.make_tensor("minus_one", TensorProto.INT64, [1], [-1])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
                   [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 12])], inits)
    _check_against_onnxruntime(model, {"x": np.random.rand(2, 3, 4).astype(np.float32)})


@pytest.mark.parametrize("causal,mask", [(0, None), (1, None), (0, "bool"), (1, "float")])
def test_attention_3d_gqa(causal, mask):
    """Attention-23 on 3-D inputs with grouped KV heads, causal and mask variants."""
    rng = np.random.default_rng(0)
    feeds = {"q": rng.standard_normal((2, 4, 32), np.float32),
             "k": rng.standard_normal((2, 6, 16), np.float32),
             "v": rng.standard_normal((2, 6, 16), np.float32)}
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, a.shape)
              for n, a in feeds.items()]
    if mask == "bool":
        feeds["m"] = rng.random((4, 6)) > 0.3
        inputs.append(helper.make_tensor_value_info("m", TensorProto.BOOL, [4, 6]))
    elif mask == "float":
        feeds["m"] = rng.standard_normal((4, 6)).astype(np.float32)
        inputs.append(helper.make_tensor_value_info("m", TensorProto.FLOAT, [4, 6]))
    node = helper.make_node("Attention", ["q", "k", "v"] + (["m"] if mask else []), ["y"],
                            q_num_heads=4, kv_num_heads=2, is_causal=causal)
    model = _model([node], inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 32])])
    _check_against_onnxruntime(model, feeds, rtol=1e-4, atol=1e-5)


def test_attention_fully_masked_row_is_zero():
    """A query row whose keys are all masked gives 0, not NaN."""
    q = np.ones((1, 1, 2, 4), np.float32)
    mask = np.array([[False, False], [True, False]])
    node = helper.make_node("Attention", ["q", "q", "q", "m"], ["y"])
    model = _model([node], [helper.make_tensor_value_info("q", TensorProto.FLOAT, q.shape),
                            helper.make_tensor_value_info("m", TensorProto.BOOL, [2, 2])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 2, 4])])
    y = gimlet_tvm.build(model, "llvm").run({"q": q, "m": mask})["y"]
    np.testing.assert_array_equal(y[0, 0, 0], np.zeros(4, np.float32))
    np.testing.assert_allclose(y[0, 0, 1], np.ones(4, np.float32))
