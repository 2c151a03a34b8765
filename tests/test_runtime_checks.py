"""Run-time data never crashes the process: an index outside its axis raises `InputError`
naming the op, the input and the value (where onnxruntime says INVALID_ARGUMENT), negative
indices wrap as ONNX defines, and the model runs the next good input."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper

import gimlet_tvm
from gimlet_tvm.compiler import INDEX_CHECKS_ENV, fusion_passes
from gimlet_tvm.errors import InputError, RunError
from gimlet_tvm.frontend import import_model
from gimlet_tvm.schedules.rules.cpu.injective import Injective
from gimlet_tvm.targets import lookup

from .conftest import assert_matches, load_script, onnxruntime_outputs

FLOAT, INT64, INT32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "checks", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs], list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _weights(name: str, shape) -> onnx.TensorProto:
    values = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    return helper.make_tensor(name, FLOAT, shape, values.ravel())


def embedding() -> onnx.ModelProto:
    """Token ids -> Gather from a 50 x 8 table -> Relu (fused with the lookup)."""
    return _model([helper.make_node("Gather", ["table", "ids"], ["rows"], name="wte"),
                   helper.make_node("Relu", ["rows"], ["y"])],
                  [("ids", INT64, [2, 5])], [("y", FLOAT, [2, 5, 8])], [_weights("table", [50, 8])])


def gather_elements() -> onnx.ModelProto:
    return _model([helper.make_node("GatherElements", ["x", "i"], ["y"], axis=1)],
                  [("x", FLOAT, [3, 6]), ("i", INT32, [3, 4])], [("y", FLOAT, [3, 4])])


def gather_nd() -> onnx.ModelProto:
    return _model([helper.make_node("GatherND", ["x", "i"], ["y"])],
                  [("x", FLOAT, [4, 5, 3]), ("i", INT64, [6, 2])], [("y", FLOAT, [6, 3])])


def scatter_elements() -> onnx.ModelProto:
    return _model([helper.make_node("ScatterElements", ["x", "i", "u"], ["y"], axis=0)],
                  [("x", FLOAT, [5, 3]), ("i", INT64, [2, 3]), ("u", FLOAT, [2, 3])], [("y", FLOAT, [5, 3])])


def scatter_nd() -> onnx.ModelProto:
    return _model([helper.make_node("ScatterND", ["x", "i", "u"], ["y"])],
                  [("x", FLOAT, [4, 5]), ("i", INT64, [3, 2]), ("u", FLOAT, [3])], [("y", FLOAT, [4, 5])])


def computed_gather() -> onnx.ModelProto:
    """Gather whose indices the model computes (ids + 10): no input holds the bad value."""
    ten = helper.make_tensor("ten", INT64, [], [10])
    return _model([helper.make_node("Add", ["ids", "ten"], ["shifted"]),
                   helper.make_node("Gather", ["table", "shifted"], ["y"])],
                  [("ids", INT64, [3])], [("y", FLOAT, [3, 8])], [_weights("table", [12, 8]), ten])


def _floats(*shape) -> np.ndarray:
    return np.random.default_rng(1).standard_normal(shape).astype(np.float32)


# model, good inputs (negative indices included), the input to spoil, where, the bad value,
# the op the error names.
CASES = {
    "Gather": (embedding, {"ids": np.array([[0, 3, -1, 49, -50], [7, 7, 8, 9, 1]], np.int64)},
               "ids", (1, 2), 60000),
    "GatherElements": (gather_elements, {"x": _floats(3, 6), "i": np.array(
        [[0, 5, -6, 2], [1, 1, -1, 3], [4, 0, 2, 5]], np.int32)}, "i", (2, 1), -7),
    "GatherND": (gather_nd, {"x": _floats(4, 5, 3), "i": np.array(
        [[0, 0], [3, 4], [-1, -5], [2, 1], [-4, 0], [1, -1]], np.int64)}, "i", (3, 1), 5),
    "ScatterElements": (scatter_elements, {"x": _floats(5, 3), "i": np.array([[0, -1, 2], [4, 1, -5]], np.int64),
                                           "u": _floats(2, 3)}, "i", (0, 2), 5),
    "ScatterND": (scatter_nd, {"x": _floats(4, 5), "i": np.array([[0, 1], [-1, -1], [2, 0]], np.int64),
                               "u": _floats(3)}, "i", (1, 0), -5),
}


@pytest.fixture(scope="module")
def compiled() -> dict[str, tuple[onnx.ModelProto, gimlet_tvm.CompiledModel]]:
    return {op: (make(), gimlet_tvm.build(make(), "llvm")) for op, (make, *_) in CASES.items()}


@pytest.mark.parametrize("op", list(CASES))
def test_bad_index_raises_and_the_model_survives(compiled, op) -> None:
    _, good, name, where, bad = CASES[op]
    model, built = compiled[op]
    assert_matches(built.run(good).values(), onnxruntime_outputs(model, good))
    spoiled = {k: v.copy() for k, v in good.items()}
    spoiled[name][where] = bad
    with pytest.raises(InputError) as raised:
        built.run(spoiled)
    message = str(raised.value)
    assert f"{op}: input '{name}' holds index {bad} at {list(where)}" in message, message
    assert_matches(built.run(good).values(), onnxruntime_outputs(model, good))


def test_onnxruntime_rejects_the_same_index() -> None:
    """The reference: onnxruntime calls the token id past the vocabulary invalid too."""
    ids = np.array([[0, 1, 60000, 2, 3]] * 2, np.int64)
    with pytest.raises(Exception, match="out of|INVALID_ARGUMENT"):
        onnxruntime_outputs(embedding(), {"ids": ids})


def test_computed_indices_name_the_op_and_extent() -> None:
    model = gimlet_tvm.build(computed_gather(), "llvm")
    good = {"ids": np.array([0, 1, -22], np.int64)}
    assert_matches(model.run(good).values(), onnxruntime_outputs(computed_gather(), good))
    with pytest.raises(InputError, match=r"Gather: an index is outside the indexed axis \(the indices "
                                         r"are computed in the model .*axis extents 12\)"):
        model.run({"ids": np.array([0, 2, 1], np.int64)})


def test_constant_indices_stay_unchecked() -> None:
    """Indices known at compile time need no check: TVM's own kernel, no assert."""
    rows = helper.make_tensor("rows", INT64, [2], [1, -1])
    model = _model([helper.make_node("Gather", ["x", "rows"], ["y"])], [("x", FLOAT, [4, 3])],
                   [("y", FLOAT, [2, 3])], [rows])
    x = _floats(4, 3)
    assert_matches(gimlet_tvm.build(model, "llvm")(x), onnxruntime_outputs(model, {"x": x}))


def test_checked_lookup_fuses_with_its_neighbour() -> None:
    """The check is inside the kernel: the Gather and the Relu after it are one kernel."""
    mod, _ = import_model(embedding())
    spec, _ = lookup("llvm")
    target = spec.make_target()
    with target:
        fused = tvm.transform.Sequential(fusion_passes(spec, target))(mod)
    checked = [func.script() for _, func in fused.functions_items()
               if isinstance(func, tvm.tirx.PrimFunc) and "gimlet-index-check" in func.script()]
    assert len(checked) == 1 and "op=Gather input=ids" in checked[0]
    assert "T.max" in checked[0]  # the Relu, in the same kernel


def _checked_kernel(model: onnx.ModelProto) -> tuple[tvm.tirx.PrimFunc, tvm.target.Target]:
    mod, _ = import_model(model)
    spec, _ = lookup("llvm")
    target = spec.make_target()
    with target:
        fused = tvm.transform.Sequential(fusion_passes(spec, target))(mod)
    func = next(func for _, func in fused.functions_items()
                if isinstance(func, tvm.tirx.PrimFunc) and "gimlet-index-check" in func.script())
    return func, target


@pytest.mark.parametrize("make, vectorized", [(embedding, True), (gather_elements, False)])
def test_checks_keep_the_axes_they_do_not_read_vectorized(make, vectorized) -> None:
    """LLVM cannot branch on a vector of conditions, so a checked kernel is vectorized only
    along the axes its check does not read: the embedding's row copy is, GatherElements (one
    index per element) is not, and both compile."""
    func, target = _checked_kernel(make())
    scheduled = Injective().apply(func, target, False)
    assert scheduled is not None
    assert ("T.vectorized" in scheduled.mod.script()) == vectorized
    tvm.compile(scheduled.mod["main"].with_attr("global_symbol", "main"), target)


def test_checks_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.setenv(INDEX_CHECKS_ENV, "0")
    mod, _ = import_model(embedding())
    spec, _ = lookup("llvm")
    target = spec.make_target()
    with target:
        fused = tvm.transform.Sequential(fusion_passes(spec, target))(mod)
    assert "gimlet-index-check" not in fused.script()


def test_artifact_keeps_the_check(tmp_path, compiled) -> None:
    _, built = compiled["Gather"]
    built.export(tmp_path / "m.so")
    loaded = gimlet_tvm.load(tmp_path / "m.so")
    ids = np.zeros((2, 5), np.int64)
    ids[0, 4] = 50
    with pytest.raises(InputError, match="input 'ids' holds index 50 at"):
        loaded(ids)
    assert loaded(ids * 0)[0].shape == (2, 5, 8)


def test_gpt2_token_id_past_the_vocabulary(cli, tmp_path) -> None:
    """The issue's case, through the CLI's compile: 60000 raises, the next prompt runs."""
    path = tmp_path / "gpt2.onnx"
    path.write_bytes(load_script("benchmarks/index_checks.py").gpt2_onnx().SerializeToString())
    code, _, err = cli("compile", str(path), "-t", "llvm", "-o", "gpt2.so")
    assert code == 0, err
    model = gimlet_tvm.load(tmp_path / "gpt2.so")
    ids = np.array([[5, 17, 60000, 3, 210, 0, 1, 2]], np.int64)
    with pytest.raises(InputError, match=r"Gather: input 'input_ids' holds index 60000 at \[0, 2\], "
                                         r"outside \[-211, 211\)"):
        model(ids)
    for good in (np.array([[5, 17, 42, 3, 210, 0, 1, 2]], np.int64), np.array([[5, -1, 42, -211, 0, 0, 1, 2]])):
        reference = onnxruntime_outputs(onnx.load(path), {"input_ids": good})
        np.testing.assert_allclose(model(good)[0], reference[0], rtol=1e-4, atol=1e-4)
    np.savez(tmp_path / "bad.npz", input_ids=ids)
    code, _, err = cli("run", "gpt2.so", "--inputs", "bad.npz")
    assert code == 2 and "input 'input_ids' holds index 60000" in err, err


def test_device_kernels_clamp_instead(compiled) -> None:
    """A device kernel cannot raise: on Vulkan (lavapipe here) a bad index reads the nearest
    row of the table, inside the buffer, and the good indices still match onnxruntime."""
    spec, _ = lookup("vulkan")
    reason = spec.can_compile() or spec.can_run()
    if reason:
        pytest.skip(f"vulkan: {reason}")
    model, _ = compiled["Gather"]
    on_device = gimlet_tvm.build(model, "vulkan")
    _, good, *_ = CASES["Gather"]
    assert_matches(on_device.run(good).values(), onnxruntime_outputs(model, good))
    ids = good["ids"].copy()
    ids[0, 0], ids[1, 1] = 60000, -60000
    rows = on_device(ids)[0]
    table = onnx.numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_allclose(rows[0, 0], np.maximum(table[49], 0), rtol=1e-6)
    np.testing.assert_allclose(rows[1, 1], np.maximum(table[0], 0), rtol=1e-6)


def _one_node(op: str, inputs, output_rank: int, outputs=("y",), **attrs) -> onnx.ModelProto:
    """One `op` node over `inputs` ((name, type, shape)), outputs of rank `output_rank`."""
    node = helper.make_node(op, [name for name, *_ in inputs], list(outputs), **attrs)
    types = {"y": FLOAT, "i": INT64}
    return _model([node], inputs, [(name, types.get(name, FLOAT), [f"{name}{k}" for k in range(output_rank)])
                                   for name in outputs])


_X = ("x", FLOAT, [3, 4])
_X4 = ("x", FLOAT, [1, 1, 3, 4])
_SHAPE = ("s", INT64, [2])
# Ops whose sizes, steps or counts come from run-time tensors: model, good values of the
# run-time inputs (x is random), bad values, the error's words. ONNX (and onnxruntime)
# rejects each bad value; before these checks some crashed the process (SIGFPE on a Slice step
# or Range delta of 0), read outside the input (a Reshape to another element count, an
# incompatible Expand) or died of std::bad_alloc.
SIZE_CASES = {
    "Slice step 0": (_one_node("Slice", [_X, ("b", INT64, [1]), ("e", INT64, [1]), ("a", INT64, [1]),
                                         ("t", INT64, [1])], 2),
                     {"b": [-100], "e": [100], "a": [1], "t": [2]}, {"t": [0]}, "Slice: a step is 0"),
    "Slice axis": (_one_node("Slice", [_X, ("b", INT64, [1]), ("e", INT64, [1]), ("a", INT64, [1])], 2),
                   {"b": [1], "e": [3], "a": [-1]}, {"a": [2]}, "Slice: an axis is outside the 2 dims"),
    "Reshape count": (_one_node("Reshape", [_X, _SHAPE], 2), {"s": [-1, 6]}, {"s": [5, 5]},
                      "Reshape: the shape does not fit the input"),
    "Reshape two -1": (_one_node("Reshape", [_X, _SHAPE], 2), {"s": [0, -1]}, {"s": [-1, -1]},
                       "Reshape: the shape does not fit the input"),
    "Expand": (_one_node("Expand", [_X, _SHAPE], 2), {"s": [1, 4]}, {"s": [5, 4]},
               "Expand: the shape does not broadcast"),
    "Expand negative": (_one_node("Expand", [_X, _SHAPE], 2), {"s": [3, 1]}, {"s": [-3, 4]},
                        "Expand: the shape does not broadcast"),
    "Tile": (_one_node("Tile", [_X, ("r", INT64, [2])], 2), {"r": [2, 1]}, {"r": [-1, 2]},
             "Tile: a repeat count is negative"),
    "Pad": (_one_node("Pad", [_X, ("p", INT64, [4])], 2), {"p": [1, -1, 0, 2]}, {"p": [-5, 0, 0, 0]},
            "pad: a size is negative"),
    "Resize scale": (_one_node("Resize", [_X4, ("r", FLOAT, [0]), ("c", FLOAT, [4])], 4, mode="nearest"),
                     {"r": np.zeros(0, np.float32), "c": np.array([1, 1, 2, 0.5], np.float32)},
                     {"c": np.array([1, 1, 0, 0], np.float32)}, "Resize: a scale is not above 0"),
    "Resize size": (_model([helper.make_node("Resize", ["x", "", "", "z"], ["y"], mode="nearest")],
                           [_X4, ("z", INT64, [4])], [("y", FLOAT, ["a", "b", "c", "d"])]),
                    {"z": [1, 1, 5, 2]}, {"z": [1, 1, -2, 4]}, "resize: a size is negative"),
    "TopK": (_one_node("TopK", [_X, ("k", INT64, [1])], 2, outputs=("y", "i")), {"k": [3]}, {"k": [9]},
             r"TopK: k is outside \[0, length of the axis\]"),
    "TopK negative": (_one_node("TopK", [_X, ("k", INT64, [1])], 2, outputs=("y", "i")), {"k": [0]}, {"k": [-2]},
                      r"TopK: k is outside"),
    "OneHot": (_one_node("OneHot", [("i", INT64, [3]), ("d", INT64, [1]), ("v", FLOAT, [2])], 2),
               {"i": [0, 7, -2], "d": [5], "v": np.array([0, 1], np.float32)}, {"d": [-4]},
               "onehot: a size is negative"),
    "ConstantOfShape": (_one_node("ConstantOfShape", [_SHAPE], 2), {"s": [2, 3]}, {"s": [-2, 3]},
                        "ConstantOfShape: a size is negative"),
    "Range": (_model([helper.make_node("Range", ["a", "b", "c"], ["y"])], [("a", INT64, []), ("b", INT64, []),
                                                                          ("c", INT64, [])], [("y", INT64, ["n"])]),
              {"a": 0, "b": 5, "c": 2}, {"c": 0}, "Range: delta is 0"),
}


def _feeds(model: onnx.ModelProto, values: dict) -> dict[str, np.ndarray]:
    """`values` as arrays of the model's input types; a random float `x` where it takes one."""
    feeds = {}
    for info in model.graph.input:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type)
        shape = [d.dim_value for d in info.type.tensor_type.shape.dim]
        feeds[info.name] = np.asarray(values[info.name], dtype) if info.name in values else _floats(*shape)
    return feeds


@pytest.mark.parametrize("case", list(SIZE_CASES))
def test_bad_sizes_raise_input_error(case) -> None:
    """Good values match onnxruntime; a bad one raises InputError naming the op (where
    onnxruntime rejects it too), and the model runs on."""
    model, good, bad, words = SIZE_CASES[case]
    built = gimlet_tvm.build(model, "llvm")
    feeds = _feeds(model, good)
    assert_matches(built.run(feeds).values(), onnxruntime_outputs(model, feeds))
    spoiled = {**feeds, **_feeds(model, {**good, **bad})}
    with pytest.raises(Exception):
        onnxruntime_outputs(model, spoiled)
    with pytest.raises(InputError, match=words):
        built.run(spoiled)
    assert_matches(built.run(feeds).values(), onnxruntime_outputs(model, feeds))


def test_a_size_past_memory_is_a_run_error() -> None:
    """Valid in shape and dtype, values whose tensor cannot be allocated (12 * 2^38 floats):
    RunError, not a crash (std::bad_alloc inside TVM)."""
    model, good, _, _ = SIZE_CASES["Tile"]
    built = gimlet_tvm.build(model, "llvm")
    with pytest.raises(RunError, match="running the model failed"):
        built.run(_feeds(model, {"r": [1 << 20, 1 << 18]}))


@pytest.mark.parametrize("case, sizes", [
    ("Tile", {"r": [1 << 40, 1 << 20]}), ("Range", {"b": 1 << 61}), ("Pad", {"p": [0, 0, 1 << 62, 0]}),
    ("ConstantOfShape", {"s": [1 << 40, 1 << 24]}), ("Resize size", {"z": [1, 1, 1 << 31, 1 << 31]}),
])
def test_a_size_whose_byte_count_wraps_is_an_input_error(case, sizes) -> None:
    """Sizes each within int64 whose product's byte count is not (12 * 2^60 floats wrap to 0
    bytes): InputError before anything is allocated; without the check the kernel wrote past
    a 0-byte allocation and the process died."""
    model, good, _, _ = SIZE_CASES[case]
    built = gimlet_tvm.build(model, "llvm")
    with pytest.raises(InputError, match="a shape computed at run time holds over 2"):
        built.run(_feeds(model, {**good, **sizes}))
    feeds = _feeds(model, good)
    assert_matches(built.run(feeds).values(), onnxruntime_outputs(model, feeds))


@pytest.mark.parametrize("case", ["Reshape count", "Slice step 0", "Expand"])
def test_size_checks_leave_device_kernels_compilable(case) -> None:
    """A device kernel cannot raise: on Vulkan (lavapipe here) the check kernels lose their
    assert (the values pass unchecked) and the model still matches onnxruntime."""
    spec, _ = lookup("vulkan")
    reason = spec.can_compile() or spec.can_run()
    if reason:
        pytest.skip(f"vulkan: {reason}")
    model, good, _, _ = SIZE_CASES[case]
    feeds = _feeds(model, good)
    assert_matches(gimlet_tvm.build(model, "vulkan").run(feeds).values(), onnxruntime_outputs(model, feeds))
