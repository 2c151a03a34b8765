"""Default kernels (issue #26): a build without a kernel selection runs the op groups its
target's rule names on that kernel (on the CPU the packed GEMM for linear layers of 2-512 rows
and a weight of at least 256x256, its B packed at build time), the others on the library; a
selection's entries win, and `$GIMLET_TVM_DEFAULT_KERNELS=0` turns the rule off. Real builds,
real kernels, outputs against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

import gimlet_tvm
from gimlet_tvm.compiler import resolve_target
from gimlet_tvm.peers import onnxruntime_session
from gimlet_tvm.schedules.kernel_selection.candidates import OpSignature
from gimlet_tvm.schedules.kernel_selection.choices import KernelSelection, OpChoice, Tried
from gimlet_tvm.schedules.kernel_selection.defaults import DEFAULT_KERNELS_ENV
from gimlet_tvm.schedules.tuning.records import target_key
from gimlet_tvm.targets.cpu import PACKED_TALL_GEMM, cpu_default_kernel
from gimlet_tvm.targets.kernels import _made
from gimlet_tvm.targets.libraries import CPU_LIBRARY

PACKED = PACKED_TALL_GEMM.name
LIBRARY_MATMUL = f"{CPU_LIBRARY.name}.matmul"
# Three linear layers: 256 -> 256 (ReLU) -> 512 (ReLU) -> 8. The first two have weights the
# rule gives the packed GEMM (at 2-512 rows), the last one's is too small.
LAYERS = [(256, 256, True), (256, 512, True), (512, 8, False)]


def mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i, (k, n, relu) in enumerate(LAYERS):
        inits += [numpy_helper.from_array((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"])]
        x = f"a{i}"
        if relu:
            nodes.append(helper.make_node("Relu", [x], [f"r{i}"]))
            x = f"r{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 256])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def calls(compiled: gimlet_tvm.CompiledModel, x: np.ndarray) -> dict[str, int]:
    """How often the VM called each function in one profiled run."""
    return {name: count for name, _, count, _ in compiled.profile([x]).calls}


def packed_calls(names: dict[str, int]) -> int:
    return sum(count for name, count in names.items() if PACKED in name)


def run_checked(compiled: gimlet_tvm.CompiledModel, x: np.ndarray) -> None:
    """The model's output matches onnxruntime's."""
    (expected,) = onnxruntime_session(mlp(), threads=1).run(None, {"x": x})
    np.testing.assert_allclose(compiled(x)[0], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch, packed", [(16, 2), (1, 0)])
def test_untuned_build_packs_the_layers_the_rule_names(batch: int, packed: int) -> None:
    """At 16 rows the two large layers run on the packed GEMM and the small one on the library;
    at 1 row all three on the library. The packed weights are constants of the build: no
    packing (pad, transpose) runs when the model does."""
    x = np.random.default_rng(1).standard_normal((batch, 256)).astype(np.float32)
    compiled = gimlet_tvm.build(mlp(), "llvm", input_shapes={"x": [batch, 256]})
    assert compiled.targets[0]["default_kernels"] == packed
    names = calls(compiled, x)
    assert packed_calls(names) == packed, names
    assert names.get(LIBRARY_MATMUL, 0) == len(LAYERS) - packed, names
    assert not [name for name in names if "transpose" in name or "pad" in name or "permute" in name], names
    run_checked(compiled, x)


def test_environment_variable_turns_the_defaults_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEFAULT_KERNELS_ENV, "0")
    x = np.random.default_rng(2).standard_normal((16, 256)).astype(np.float32)
    compiled = gimlet_tvm.build(mlp(), "llvm", input_shapes={"x": [16, 256]})
    assert compiled.targets[0]["default_kernels"] == 0
    names = calls(compiled, x)
    assert names.get(LIBRARY_MATMUL, 0) == len(LAYERS) and packed_calls(names) == 0, names
    run_checked(compiled, x)


def test_selection_wins_entry_by_entry() -> None:
    """A selection with an entry for the first layer only (the library): that layer runs on the
    library, the second still gets its default."""
    _, target = resolve_target("llvm")
    first = OpSignature("matmul", ((16, 256), (256, 256)), "float32", (("add", (256,)), ("relu", ())), weight=True)
    selection = KernelSelection(target_key(target), {first.key: OpChoice(
        first, [Tried("library:openblas", "", True, seconds=1.0)], "library:openblas")})
    x = np.random.default_rng(3).standard_normal((16, 256)).astype(np.float32)
    compiled = gimlet_tvm.build(mlp(), "llvm", input_shapes={"x": [16, 256]}, selection=selection)
    assert compiled.targets[0]["selected_kernels"] == 1 and compiled.targets[0]["default_kernels"] == 1
    names = calls(compiled, x)
    assert packed_calls(names) == 1 and names.get(LIBRARY_MATMUL, 0) == 2, names
    run_checked(compiled, x)


@pytest.mark.parametrize("shapes, weight, dtype, chosen", [
    (((32, 1024), (1024, 4096)), True, "float32", True),   # the MLP's first layer at batch 32
    (((1, 128, 768), (768, 3072)), True, "float32", True),  # BERT's FFN, batch axes folded
    (((1, 1024), (1024, 4096)), True, "float32", False),   # one row: memory-bound
    (((1024, 1024), (1024, 1024)), True, "float32", False),  # more rows than measured to win
    (((32, 64), (64, 96)), True, "float32", False),        # a small weight
    (((32, 1024), (1024, 4096)), False, "float32", False),  # B no constant: cannot be packed
    (((32, 1024), (1024, 4096)), True, "float16", False),
])
def test_cpu_rule(shapes, weight: bool, dtype: str, chosen: bool) -> None:
    _, target = resolve_target("llvm")
    sig = OpSignature("matmul", shapes, dtype, weight=weight)
    assert cpu_default_kernel(target, sig) == (f"handwritten:{PACKED}" if chosen else None)


def test_a_model_the_rule_leaves_alone_builds_as_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A conv and a one-row linear layer: no default applies, and the build's calls are the
    ones it makes with the rule off (its op groups are not even formed)."""
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in {"w": (8, 4, 3, 3), "fc": (8 * 6 * 6, 256)}.items()]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("MatMul", ["f", "fc"], ["y"])]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((1, 4, 6, 6)).astype(np.float32)
    with_rule = gimlet_tvm.build(model, "llvm")
    monkeypatch.setenv(DEFAULT_KERNELS_ENV, "0")
    without = gimlet_tvm.build(model, "llvm")
    assert with_rule.targets[0]["default_kernels"] == 0
    names = calls(with_rule, x)
    assert names == calls(without, x) and names.get(LIBRARY_MATMUL) == 1, names
    (expected,) = onnxruntime_session(model, threads=1).run(None, {"x": x})
    np.testing.assert_allclose(with_rule(x)[0], expected, rtol=1e-4, atol=1e-4)


def test_a_damaged_kernel_cache_file_is_made_again(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parsed hand-written kernels kept on disk: a file cut short (a full disk, a killed
    writer) is not an error; the kernel is made again and the file rewritten whole."""
    monkeypatch.setenv("GIMLET_TVM_CACHE", str(tmp_path))
    target = resolve_target("llvm")[1]
    made = PACKED_TALL_GEMM.prim_func(target, 24, 64, 48, (), [])
    [path] = (tmp_path / "handwritten").iterdir()
    path.write_text(path.read_text()[:100])
    _made.cache_clear()
    remade = PACKED_TALL_GEMM.prim_func(target, 24, 64, 48, (), [])
    tvm.ir.assert_structural_equal(made, remade)
    tvm.ir.assert_structural_equal(tvm.ir.load_json(path.read_text()), made)
