"""The fuzzer's seed models: small ONNX graphs built in code, one per kind of structure the
mutators have something to break in (weights, convolutions, indexing, subgraphs, kernels that
tuning records apply to). Weights are seeded, so every build gives the same bytes."""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _weights(rng: np.random.Generator, **shapes: tuple[int, ...]) -> list[onnx.TensorProto]:
    return [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
            for name, shape in shapes.items()]


def _model(nodes, name, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)


def mlp() -> onnx.ModelProto:
    """Gemm, Relu, Gemm over a symbolic batch."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="gemm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], name="gemm2"),
    ]
    return _model(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
                  _weights(rng, w1=(8, 16), b1=(16,), w2=(16, 4), b2=(4,)))


def conv() -> onnx.ModelProto:
    """Conv, Relu, MaxPool, Flatten."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["y"], name="flatten"),
    ]
    return _model(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
                  _weights(rng, w=(4, 3, 3, 3), b=(4,)))


def gather() -> onnx.ModelProto:
    """An embedding lookup: Gather of run-time indices from a table, then Reshape."""
    rng = np.random.default_rng(2)
    shape = numpy_helper.from_array(np.array([-1], dtype=np.int64), "flat")
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["rows"], name="lookup", axis=0),
        helper.make_node("Reshape", ["rows", "flat"], ["y"], name="reshape"),
    ]
    return _model(nodes, "gather", [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [12])],
                  [*_weights(rng, table=(10, 4)), shape])


def branch() -> onnx.ModelProto:
    """An If whose branches are subgraphs reading the outer scope: x + c or x * c."""
    rng = np.random.default_rng(3)
    out = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [4])
    then_graph = helper.make_graph([helper.make_node("Add", ["x", "c"], ["t"], name="add")],
                                   "then", [], [out("t")])
    else_graph = helper.make_graph([helper.make_node("Mul", ["x", "c"], ["e"], name="mul")],
                                   "else", [], [out("e")])
    nodes = [helper.make_node("If", ["cond"], ["y"], name="choose", then_branch=then_graph,
                              else_branch=else_graph)]
    return _model(nodes, "branch",
                  [helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
                   helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                  [out("y")], _weights(rng, c=(4,)))


def softmax() -> onnx.ModelProto:
    """relu(x + b) then Softmax: kernels of our own (no library call), which tuning records
    schedule."""
    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("Add", ["x", "b"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["r"], name="relu"),
        helper.make_node("Softmax", ["r"], ["y"], name="softmax", axis=-1),
    ]
    return _model(nodes, "softmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 32])],
                  _weights(rng, b=(32,)))


SEEDS: dict[str, Callable[[], onnx.ModelProto]] = {
    "mlp": mlp, "conv": conv, "gather": gather, "branch": branch, "softmax": softmax,
}
RECORDS_SEED = "softmax"
"""The seed whose kernels the seed tuning records are made for."""
