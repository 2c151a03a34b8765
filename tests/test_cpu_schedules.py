"""Default CPU schedule rules: every PrimFunc of the suite's models gets one, the scheduled
code matches onnxruntime, and rules that do not fit a function decline instead of failing."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from onnx import helper
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx

from gimlet_tvm import models
from gimlet_tvm.compiler import canonicalize_passes
from gimlet_tvm.schedules.rules.cpu import RULES
from gimlet_tvm.schedules.rules.cpu.normalization import Normalization
from gimlet_tvm.schedules.rules.cpu.window_reduction import WindowReduction
from gimlet_tvm.relax_passes.library_dispatch import library_passes
from gimlet_tvm.targets.llvm import LLVM_CPU

from .test_cpu_library import TARGET, onnx_model, rand, run_both

SMALL_MODELS = [name for name, info in models.SUITE.items() if info.in_tests]


def fused_prim_funcs(mod: tvm.IRModule) -> dict[str, tvm.tirx.PrimFunc]:
    """The PrimFuncs the llvm pipeline hands to the schedule rules."""
    passes = [
        *canonicalize_passes(),
        *library_passes(LLVM_CPU),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]
    with TARGET:
        mod = tvm.transform.Sequential(passes)(mod)
    return {
        gv.name_hint: func
        for gv, func in mod.functions_items()
        if isinstance(func, tvm.tirx.PrimFunc)
    }


def first_rule(func: tvm.tirx.PrimFunc) -> str | None:
    """Name of the first rule that schedules `func`."""
    for rule in RULES:
        if rule().apply(func, TARGET, False) is not None:
            return rule.__name__
    return None


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_every_fused_function_is_scheduled(name: str) -> None:
    mod = from_onnx(models.SUITE[name].build(), keep_params_in_input=False)
    unscheduled = [fn for fn, func in fused_prim_funcs(mod).items() if first_rule(func) is None]
    assert unscheduled == []


def test_rules_decline_what_they_do_not_fit() -> None:
    """Every rule on every function of a model: a schedule or None, never an exception."""
    functions = [
        func
        for name in ("transformer_encoder", "mobilenet_cnn")
        for func in fused_prim_funcs(
            from_onnx(models.SUITE[name].build(), keep_params_in_input=False)
        ).values()
    ]
    for func in functions:
        for rule in RULES:
            rule().apply(func, TARGET, False)
    # A GPU target is never scheduled by CPU rules.
    gpu = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    assert all(rule().apply(f, gpu, False) is None for rule in RULES for f in functions)


def op_cases() -> list:
    """(id, nodes, input shape, initializers, expected rule of the main kernel)."""
    gelu = [
        helper.make_node("Div", ["x", "sqrt2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["a"]),
        helper.make_node("Mul", ["x", "a"], ["m"]),
        helper.make_node("Mul", ["m", "half"], ["y"]),
    ]
    gelu_consts = {"sqrt2": np.array(np.sqrt(2), np.float32), "one": np.array(1, np.float32),
                   "half": np.array(0.5, np.float32)}
    depthwise = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], group=12, kernel_shape=[3, 3],
                         pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Clip", ["c", "lo", "hi"], ["y"]),
    ]
    depthwise_consts = {"w": rand(12, 1, 3, 3, seed=1), "b": rand(12, seed=2),
                        "lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}
    return [
        ("gelu", gelu, [3, 37, 50], gelu_consts, "Injective"),
        ("transpose", [helper.make_node("Transpose", ["x"], ["y"], perm=[0, 2, 1, 4, 3])],
         [5, 7, 9, 11], {}, "Injective"),
        ("softmax", [helper.make_node("Softmax", ["x"], ["y"], axis=-1)], [4, 19, 77], {},
         "Normalization"),
        ("layer_norm", [helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)],
         [6, 13, 40], {"g": rand(40, seed=3), "b": rand(40, seed=4)}, "Normalization"),
        # Rows of whole vectors: the reductions are factored into vector lanes.
        ("softmax_vector_rows", [helper.make_node("Softmax", ["x"], ["y"], axis=-1)], [3, 5, 96],
         {}, "Normalization"),
        ("layer_norm_vector_rows",
         [helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)], [7, 256],
         {"g": rand(256, seed=3), "b": rand(256, seed=4)}, "Normalization"),
        ("max_pool", [helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3],
                                       strides=[2, 2], pads=[1, 1, 1, 1])],
         [3, 23, 23], {}, "WindowReduction"),
        ("avg_pool", [helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2],
                                       strides=[2, 2])],
         [5, 18, 18], {}, "WindowReduction"),
        ("depthwise_relu6", depthwise, [12, 21, 21], depthwise_consts, "WindowReduction"),
        ("global_mean", [helper.make_node("ReduceMean", ["x"], ["y"], axes=[2, 3], keepdims=1)],
         [7, 5, 6], {}, None),
        ("row_sum", [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)],
         [9, 300], {"axes": np.array([2], np.int64)}, "RowReduction"),
    ]


@pytest.mark.parametrize("case", op_cases(), ids=lambda case: case[0])
def test_scheduled_ops_against_onnxruntime(case: tuple) -> None:
    """Each op with a symbolic batch, run at batch 1 and 8; odd sizes exercise loop tails."""
    _, nodes, shape, consts, expected_rule = case
    model = onnx_model(nodes, [("x", ["batch", *shape])], ("y", None), consts)
    functions = fused_prim_funcs(from_onnx(model, keep_params_in_input=False))
    rules = {first_rule(func) for func in functions.values()}
    assert None not in rules
    if expected_rule is not None:
        assert expected_rule in rules
    for batch in (1, 8):
        ours, reference = run_both(model, {"x": rand(batch, *shape, seed=batch)})
        np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("width, factored", [(256, True), (96, True), (40, False), (16, False)])
def test_normalization_factors_reductions_over_whole_vectors(width: int, factored: bool) -> None:
    """A layer norm's reductions over rows of at least two whole vectors become per-lane partial
    sums updated by vector instructions; other rows keep DLight's scalar reduction."""
    model = onnx_model([helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)],
                       [("x", ["batch", 3, width])], ("y", None),
                       {"g": rand(width, seed=3), "b": rand(width, seed=4)})
    [func] = [f for f in fused_prim_funcs(from_onnx(model, keep_params_in_input=False)).values()
              if first_rule(f) == "Normalization"]
    lines = Normalization().apply(func, TARGET, False).mod.script().splitlines()
    # A partial-sum block (rfactor names it "<reduction>_rf") right inside a vectorized loop.
    partial_sums = [block for loop, block in zip(lines, lines[1:])
                    if "T.vectorized(" in loop and re.search(r'T\.sblock\("\w+_rf"\)', block)]
    assert bool(partial_sums) == factored


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_suite_model_against_onnxruntime(name: str) -> None:
    info = models.SUITE[name]
    model = info.build()
    for batch in (1, 8):
        ours, reference = run_both(model, info.example_inputs(batch))
        np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)


def test_window_reduction_writes_all_of_an_epilogue_larger_than_it() -> None:
    """A pad after a pooling window (fused into its kernel) covers more than the reduction's
    rows: every output point is written (the output buffer starts as NaN)."""
    nodes = [helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[3, 3]),
             helper.make_node("Pad", ["p", "pads"], ["y"])]
    pads = np.array([0, 0, 0, 0, 0, 0, 1, 2], np.int64)
    model = onnx_model(nodes, [("x", [1, 3, 9, 12])], ("y", None), {"pads": pads})
    functions = fused_prim_funcs(from_onnx(model, keep_params_in_input=False))
    scheduled = {name: WindowReduction().apply(func, TARGET, False) for name, func in functions.items()}
    name, sch = next((name, sch) for name, sch in scheduled.items() if sch is not None)
    x = rand(1, 3, 9, 12, seed=5)
    results = []
    for func in (functions[name], sch.mod["main"]):
        kernel = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                             target=TARGET)
        out = tvm.runtime.tensor(np.full((1, 3, 8, 12), np.nan, np.float32))
        kernel["main"](tvm.runtime.tensor(x), out)
        results.append(out.numpy())
    assert not np.isnan(results[1]).any()
    np.testing.assert_array_equal(results[1], results[0])


@pytest.mark.parametrize("channels, size", [(232, 14), (116, 28), (464, 7)])
def test_channel_shuffle_vectors_stay_within_a_channel(channels: int, size: int) -> None:
    """ShuffleNet's channel shuffle (reshape to two groups, swap them, reshape back) reads
    channel c % 2 * C / 2 + c // 2: its vectors run along one channel's pixels, the channel
    axis bound to no vectorized loop (across channels each lane's address is its own); and it
    computes what onnxruntime does."""
    half = channels // 2
    nodes = [
        helper.make_node("Reshape", ["x", "grouped"], ["g"]),
        helper.make_node("Transpose", ["g"], ["t"], perm=[0, 2, 1, 3, 4]),
        helper.make_node("Reshape", ["t", "flat"], ["y"]),
    ]
    consts = {"grouped": np.array([2, 2, half, size, size], np.int64),
              "flat": np.array([2, channels, size, size], np.int64)}
    model = onnx_model(nodes, [("x", [2, channels, size, size])], ("y", None), consts)
    (func,) = fused_prim_funcs(from_onnx(model, keep_params_in_input=False)).values()
    scheduled = RULES[0]().apply(func, TARGET, False).mod.script()
    vector_loops = re.findall(r"for (\w+) in T\.vectorized", scheduled)
    channel_axes = re.findall(rf"\w+ = T\.axis\.spatial\(T\.int64\({channels}\), (.*)\)", scheduled)
    assert vector_loops and channel_axes
    assert not any(re.search(rf"\b{loop}\b", axis) for loop in vector_loops for axis in channel_axes), scheduled
    ours, reference = run_both(model, {"x": rand(2, channels, size, size, seed=1)})
    np.testing.assert_array_equal(ours, reference)
