"""Bad input gets a typed error that names the problem, and leaves no file behind."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import gimlet_tvm
from gimlet_tvm.errors import (
    ArtifactError,
    GimletError,
    InputError,
    ModelLoadError,
    RunError,
    UnknownTargetError,
    UnsupportedOpError,
)

from . import fuzz_seeds
from .conftest import compiled_suite_model, suite_model


def unsupported_ops_model() -> onnx.ModelProto:
    """Relu between two ops no importer knows, one of them used twice."""
    nodes = [
        helper.make_node("Mystery", ["x"], ["a"], name="first_mystery", domain="com.example"),
        helper.make_node("Relu", ["a"], ["b"], name="relu"),
        helper.make_node("Mystery", ["b"], ["c"], name="second_mystery", domain="com.example"),
        helper.make_node("Enigma", ["c"], ["y"], name="the_enigma", domain="com.example"),
    ]
    graph = helper.make_graph(
        nodes,
        "unsupported",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def test_missing_model_file(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="model file not found: .*nope.onnx"):
        gimlet_tvm.build(str(tmp_path / "nope.onnx"))


def test_file_that_is_not_onnx(tmp_path) -> None:
    path = tmp_path / "notes.onnx"
    path.write_text("these are not the weights you are looking for\n")
    with pytest.raises(ModelLoadError, match="not an ONNX model"):
        gimlet_tvm.build(str(path))


def test_invalid_graph_is_rejected_by_checker() -> None:
    model = suite_model("mlp")
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    broken.graph.node[0].input[0] = "no_such_tensor"
    with pytest.raises(ModelLoadError, match="invalid ONNX model"):
        gimlet_tvm.build(broken)


def test_every_unsupported_op_listed_with_its_nodes() -> None:
    with pytest.raises(UnsupportedOpError) as info:
        gimlet_tvm.build(unsupported_ops_model())
    assert info.value.ops == {
        "com.example::Mystery": ["first_mystery", "second_mystery"],
        "com.example::Enigma": ["the_enigma"],
    }
    message = str(info.value)
    assert "com.example::Mystery (nodes: first_mystery, second_mystery)" in message
    assert "com.example::Enigma (nodes: the_enigma)" in message


@pytest.mark.parametrize("target", ["tpu9000", {"kind": "quantum"}])
def test_unknown_target_lists_known_ones(target) -> None:
    with pytest.raises(UnknownTargetError, match=r"unknown target .* known targets: .*llvm"):
        gimlet_tvm.build(suite_model("mlp"), target)


def test_a_target_given_twice_is_refused() -> None:
    with pytest.raises(GimletError, match="a target is given twice: llvm, llvm"):
        gimlet_tvm.build(suite_model("mlp"), ["llvm", "llvm"])


def test_target_dict_and_one_element_list_accepted() -> None:
    model = gimlet_tvm.build(suite_model("mlp"), [{"kind": "llvm", "num-cores": 1}])
    assert model.targets[0]["name"] == "llvm"
    assert model.targets[0]["target"]["num-cores"] == 1


def test_input_shapes_with_unknown_name() -> None:
    with pytest.raises(InputError, match=r"unknown input\(s\) \['y'\]"):
        gimlet_tvm.build(suite_model("mlp"), input_shapes={"y": [1, 1024]})


def test_input_shapes_conflicting_with_model() -> None:
    with pytest.raises(InputError, match="does not fit the model's x: float32\\[batch, 1024\\]"):
        gimlet_tvm.build(suite_model("mlp"), input_shapes={"x": [1, 512]})


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({"x": np.zeros((1, 1024), np.float64)}, "input 'x' has dtype float64, expected float32"),
        ({"x": np.zeros((1, 1000), np.float32)}, r"input 'x' has shape \[1, 1000\], expected 1024 at axis 1"),
        ({"x": np.zeros((1024,), np.float32)}, "expected rank 2"),
        ({"z": np.zeros((1, 1024), np.float32)}, r"unknown input\(s\) \['z'\]"),
        ({}, r"missing input\(s\) \['x'\]"),
    ],
)
def test_wrong_inputs_name_the_input(inputs, message) -> None:
    model = compiled_suite_model("mlp")
    with pytest.raises(InputError, match=message):
        model.run(inputs)


def test_wrong_input_count() -> None:
    with pytest.raises(InputError, match=r"expected 1 input\(s\) \['x'\], got 2"):
        compiled_suite_model("mlp")(np.zeros((1, 1024), np.float32), np.zeros(1, np.float32))


def test_symbolic_dim_must_agree_across_inputs() -> None:
    model = compiled_suite_model("transformer_encoder")
    x = np.zeros((2, 64, 256), np.float32)
    mask = np.ones((3, 64), np.int64)
    with pytest.raises(InputError, match="'attention_mask' has batch=3 .* input 'x' set batch=2"):
        model(x, mask)


@pytest.fixture
def exported(tmp_path):
    path = tmp_path / "mlp.so"
    compiled_suite_model("mlp").export(path)
    return path


def test_truncated_artifact(exported) -> None:
    data = exported.read_bytes()
    exported.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="not a gimlet-tvm artifact"):
        gimlet_tvm.load(exported)


def test_altered_artifact(exported) -> None:
    data = bytearray(exported.read_bytes())
    data[100] ^= 0xFF
    exported.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        gimlet_tvm.load(exported)


def test_artifact_with_edited_interface(exported) -> None:
    """The metadata is valid JSON with the input's shape changed: its own checksum refuses it
    (without it, the model would run against an interface it was not built for)."""
    data = exported.read_bytes()
    edited = data.replace(b'"shape": ["batch", 1024]', b'"shape": ["batch", 1023]', 1)
    assert edited != data
    exported.write_bytes(edited)
    with pytest.raises(ArtifactError, match="metadata checksum mismatch"):
        gimlet_tvm.load(exported)


def test_failure_in_tvms_runtime_is_a_run_error() -> None:
    """An If whose condition the model declares float: the importer accepts it, TVM's VM
    refuses the condition at run time."""
    model = onnx.ModelProto()
    model.CopyFrom(fuzz_seeds.branch())
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT
    compiled = gimlet_tvm.build(model)
    with pytest.raises(RunError, match="running the model failed: .*kDLBool"):
        compiled(np.array(1.0, np.float32), np.ones(4, np.float32))


def test_missing_artifact(tmp_path) -> None:
    with pytest.raises(ArtifactError, match="artifact not found"):
        gimlet_tvm.load(tmp_path / "none.so")


def test_failed_export_leaves_no_file(tmp_path, monkeypatch) -> None:
    model = compiled_suite_model("mlp")

    def broken_export(path: str, **kwargs) -> None:
        with open(path, "wb") as f:
            f.write(b"half a library")
        raise OSError("disk full")

    monkeypatch.setattr(model._module, "export_library", broken_export, raising=False)
    with pytest.raises(OSError, match="disk full"):
        model.export(tmp_path / "out.so")
    assert list(tmp_path.iterdir()) == []
