"""Memory limits: a model whose declared sizes need more memory than the machine has is refused
up front, with the figure, when compiling and when loading; normal models are untouched."""

from __future__ import annotations

import os
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gimlet_tvm
from gimlet_tvm.errors import GimletError, ResourceLimitError
from gimlet_tvm.frontend import declared_memory
from gimlet_tvm.resources import ENV, available_memory, format_bytes

from .test_cli import one_line_error
from .test_tuning import tiny_model

HUGE = [100000, 100000, 100]  # 10^12 float32 elements: 3.6 TiB


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "huge", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def huge_input_model() -> onnx.ModelProto:
    """relu(x) for an x of HUGE shape: a graph of a few bytes declaring 7.3 TiB of tensors."""
    return _model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, HUGE)],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, HUGE)])


def huge_constant_model() -> onnx.ModelProto:
    """x + ConstantOfShape(HUGE): the huge tensor is an intermediate, its shape a constant."""
    shape = numpy_helper.from_array(np.array(HUGE, dtype=np.int64), "shape")
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["big"], name="fill"),
             helper.make_node("Add", ["x", "big"], ["y"], name="add")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b", "c"])], [shape])


def test_a_huge_declared_input_is_refused_before_anything_is_allocated():
    start = time.monotonic()
    with pytest.raises(ResourceLimitError) as err:
        gimlet_tvm.build(huge_input_model(), "llvm")
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert "the model 'huge' needs at least 7.3 TiB (8000000000000 bytes) of memory" in message
    assert "the biggest tensor: input 'x' [100000, 100000, 100] float32, 3.6 TiB" in message
    assert f"available ({available_memory()[1]})" in message and f"{ENV}=off" in message


def test_a_huge_intermediate_is_found_by_shape_inference():
    need = declared_memory(huge_constant_model())
    assert need.total >= 4 * 10**12 and need.peak[1] == "Add node 'add'"
    assert need.biggest[0].endswith("[100000, 100000, 100] float32")  # 'big' or 'y', as large
    with pytest.raises(ResourceLimitError, match="Add node .add. [37].[36] TiB"):
        gimlet_tvm.build(huge_constant_model(), "llvm")


def test_the_cli_refuses_in_one_line(cli, tmp_path):
    onnx.save(huge_input_model(), tmp_path / "huge.onnx")
    line = one_line_error(*cli("compile", "huge.onnx", "-t", "llvm", "-o", "huge.so"))
    assert "needs at least 7.3 TiB" in line and "input 'x'" in line
    assert not (tmp_path / "huge.so").exists()


def test_the_limit_from_the_environment(monkeypatch, tmp_path):
    """A normal model builds and loads; below a limit set from the environment, compiling and
    loading its artifact are refused, naming its weights or its file; `off` skips the check."""
    model = gimlet_tvm.build(tiny_model(), "llvm")  # the machine's own limit: builds
    artifact = tmp_path / "tiny.so"
    model.export(artifact)
    monkeypatch.setenv(ENV, "20K")
    with pytest.raises(ResourceLimitError) as err:
        gimlet_tvm.build(tiny_model(), "llvm")
    assert ("needs at least 33.0 KiB (33796 bytes) of memory, 20.0 KiB available "
            f"({ENV}=20K): weights 1.0 KiB, the inputs and outputs 32.0 KiB; the biggest tensor: "
            "input 'x' [16, 256] float32, 16.0 KiB") in str(err.value)
    size = artifact.stat().st_size
    monkeypatch.setenv(ENV, f"{size // 1024}K")
    with pytest.raises(ResourceLimitError) as err:
        gimlet_tvm.load(artifact)
    assert f"loading {artifact} needs at least" in str(err.value)
    assert f"the artifact (code and weights) {format_bytes(size)}" in str(err.value)
    assert f"available ({ENV}={size // 1024}K)" in str(err.value)
    monkeypatch.setenv(ENV, "1G")
    x = np.ones((16, 256), np.float32)
    np.testing.assert_allclose(gimlet_tvm.load(artifact)(x)[0], model(x)[0])
    monkeypatch.setenv(ENV, "off")
    assert available_memory() is None
    gimlet_tvm.load(artifact)
    monkeypatch.setenv(ENV, "lots")
    with pytest.raises(GimletError, match=f"{ENV} must be a byte count"):
        available_memory()


def test_the_machine_figure():
    available, source = available_memory()
    assert 0 < available <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert source in ("physical memory", "MemAvailable", "the cgroup's memory limit less its usage")
