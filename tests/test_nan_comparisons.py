"""Negated float comparisons and NaN (relax_passes/nan_safe_comparisons.py): every target
gives onnxruntime's IEEE answers, where TVM's simplifier and code generators alone do not."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import gimlet_tvm

from .conftest import onnxruntime_outputs

COMPARISONS = ["Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Equal"]


def negated(op: str) -> onnx.ModelProto:
    """Not(op(x, y)) and, as a NaN test, Not(Equal(x, x))."""
    nodes = [helper.make_node(op, ["x", "y"], ["c"]), helper.make_node("Not", ["c"], ["z"]),
             helper.make_node("Equal", ["x", "x"], ["same"]), helper.make_node("Not", ["same"], ["nan"])]
    tensor = lambda name, kind: helper.make_tensor_value_info(name, kind, [2, 3])  # noqa: E731
    graph = helper.make_graph(nodes, "negated", [tensor("x", TensorProto.FLOAT), tensor("y", TensorProto.FLOAT)],
                              [tensor("z", TensorProto.BOOL), tensor("nan", TensorProto.BOOL)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


@pytest.mark.parametrize("target", ["llvm", "vulkan"])
@pytest.mark.parametrize("op", COMPARISONS)
def test_negated_comparison_with_nan_matches_onnxruntime(op, target):
    model = negated(op)
    inputs = {"x": np.array([[np.nan, 1, 2], [np.inf, -np.inf, 0]], np.float32),
              "y": np.array([[1, np.nan, 2], [np.inf, 0, np.nan]], np.float32)}
    ours = gimlet_tvm.build(model, target).run(inputs)
    for got, want in zip(ours.values(), onnxruntime_outputs(model, inputs)):
        np.testing.assert_array_equal(got, want)
