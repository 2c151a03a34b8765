"""Inputs and outputs crossing the runtime's boundary on the host: an aligned input array is
shared with its tensor, an unaligned one copied to an aligned buffer unless only the CPU
library reads it; either way the model sees the same values, the caller's arrays stay as they
were and outputs are arrays of their own."""

from __future__ import annotations

import numpy as np
import tvm
from onnx import TensorProto, helper, numpy_helper

import gimlet_tvm
from gimlet_tvm.runtime.tensors import TENSOR_ALIGNMENT, device_tensors

from .test_cpu_library import onnx_model, rand


def at_offset(array: np.ndarray, offset: int) -> np.ndarray:
    """A copy of `array` whose data starts `offset` bytes past a TENSOR_ALIGNMENT boundary."""
    buffer = np.empty(array.nbytes + 2 * TENSOR_ALIGNMENT, np.uint8)
    start = -buffer.ctypes.data % TENSOR_ALIGNMENT + offset
    copy = buffer[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


def test_aligned_and_unaligned_inputs_give_the_same_result() -> None:
    model = onnx_model([helper.make_node("Mul", ["x", "x"], ["m"]),
                        helper.make_node("Add", ["m", "w"], ["y"])],
                       [("x", [4, 33])], ("y", [4, 33]), {"w": rand(4, 33, seed=1)})
    compiled = gimlet_tvm.build(model, "llvm")
    x = rand(4, 33)
    expected = x * x + rand(4, 33, seed=1)
    for offset in (0, 4, 16, 48):
        array = at_offset(x, offset)
        assert array.ctypes.data % TENSOR_ALIGNMENT == offset
        np.testing.assert_allclose(compiled.run({"x": array})["y"], expected, rtol=1e-6)
        np.testing.assert_array_equal(array, x)


def test_an_aligned_input_is_shared_and_an_unaligned_one_copied() -> None:
    x = rand(8, 16)
    aligned, unaligned = at_offset(x, 0), at_offset(x, 16)
    shared, copied = device_tensors([aligned, unaligned], tvm.cpu())
    assert np.from_dlpack(shared).ctypes.data == aligned.ctypes.data
    assert np.from_dlpack(copied).ctypes.data % TENSOR_ALIGNMENT == 0
    np.testing.assert_array_equal(np.from_dlpack(copied), x)


def test_outputs_are_arrays_of_their_own() -> None:
    """A model returning its input unchanged: the output is not the caller's input memory, and
    one call's output is not the next call's."""
    model = onnx_model([helper.make_node("Identity", ["x"], ["y"])], [("x", [3, 16])], ("y", [3, 16]), {})
    compiled = gimlet_tvm.build(model, "llvm")
    assert compiled.targets[0]["unaligned_inputs"] == [False]  # the output is the input
    x = at_offset(rand(3, 16), 0)
    first = compiled.run({"x": x})["y"]
    first[...] = 0
    np.testing.assert_array_equal(x, rand(3, 16))
    second = compiled.run({"x": x})["y"]
    np.testing.assert_array_equal(second, x)
    np.testing.assert_array_equal(first, 0)


def test_inputs_only_the_cpu_library_reads_are_not_copied(tmp_path) -> None:
    """`x` goes straight to a conv of the CPU library (unaligned loads), `y` to its epilogue
    (a residual add): both are passed as they are at any offset; `z` is read by a generated
    kernel (aligned loads), so it is copied when unaligned. Results match onnxruntime at every
    offset, and an exported artifact keeps the choice."""
    import onnxruntime  # pylint: disable=import-outside-toplevel

    weight = rand(8, 3, 3, 3, seed=2)
    model = onnx_model(
        [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
         helper.make_node("Mul", ["z", "z"], ["zz"]),
         helper.make_node("Add", ["c", "zz"], ["s"]),
         helper.make_node("Add", ["s", "y"], ["out"])],
        [("x", [2, 3, 10, 12]), ("z", [2, 8, 10, 12]), ("y", [2, 8, 10, 12])],
        ("out", [2, 8, 10, 12]), {"w": weight})
    compiled = gimlet_tvm.build(model, "llvm")
    assert compiled.targets[0]["unaligned_inputs"] == [True, False, True]
    assert compiled.targets[0]["fresh_outputs"] == [True]
    inputs = {"x": rand(2, 3, 10, 12, seed=3), "z": rand(2, 8, 10, 12, seed=4), "y": rand(2, 8, 10, 12, seed=5)}
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, inputs)[0]
    for offset in (0, 4, 16):
        moved = {name: at_offset(array, offset) for name, array in inputs.items()}
        np.testing.assert_allclose(compiled.run(moved)["out"], expected, rtol=1e-5, atol=1e-5)
        passed, copied, _ = device_tensors(list(moved.values()), tvm.cpu(), (True, False, True))
        assert np.from_dlpack(passed).ctypes.data == moved["x"].ctypes.data
        assert np.from_dlpack(copied).ctypes.data % TENSOR_ALIGNMENT == 0
    compiled.export(tmp_path / "model.so")
    assert gimlet_tvm.load(tmp_path / "model.so").targets[0]["unaligned_inputs"] == [True, False, True]


def test_outputs_the_call_allocates_are_handed_over() -> None:
    """An output the call computes into memory of its own becomes the caller's array without a
    copy; one that is a weight, or the same tensor as an earlier output, is still copied: what
    one call returned can be changed without changing the model or a later call's outputs."""
    weight = rand(3, 16, seed=2)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["same"]),
         helper.make_node("Identity", ["w"], ["weight"])],
        "outputs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 16])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [3, 16]) for name in ("r", "same", "weight")],
        [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    compiled = gimlet_tvm.build(model, "llvm")
    assert compiled.targets[0]["fresh_outputs"] == [True, False, False]
    x = rand(3, 16)
    first = compiled(x)
    assert first[0].flags.writeable and all(not np.shares_memory(first[0], a) for a in first[1:])
    assert first[0].base is not None and first[1].base is None  # over the tensor; a copy
    for array in first:
        array[...] = -1
    second = compiled(x)
    np.testing.assert_array_equal(second[0], np.maximum(x, 0))
    np.testing.assert_array_equal(second[1], np.maximum(x, 0))
    np.testing.assert_array_equal(second[2], weight)
    assert not np.shares_memory(first[0], second[0])
