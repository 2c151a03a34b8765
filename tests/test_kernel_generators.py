"""Kernel generators in the selection loop (docs/kernel-generators.md): the protocol's task and
answers checked against its schema, rounds with feedback, failed rounds that do not fail
selection, and generated kernels verified in the child like every candidate. The generator
here is `scripted_generator.py` (real processes, real builds, real checks)."""

from __future__ import annotations

import ctypes
import dataclasses
import http.server
import json
import os
import re
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
from numpy.lib.stride_tricks import sliding_window_view
import pytest
from onnx import TensorProto, helper

import gimlet_tvm
from gimlet_tvm.compiler import resolve_target
from gimlet_tvm.errors import GimletError, UnsafeKernelError
from gimlet_tvm.frontend import import_model
from gimlet_tvm.peers import check_against_onnxruntime
from gimlet_tvm.schedules.kernel_selection.candidates import MAX_TASKS, OpSignature
from gimlet_tvm.schedules.kernel_selection.external import add_kernel, shared_library
from gimlet_tvm.schedules.kernel_selection.sources import find
from gimlet_tvm.schedules.kernel_selection.choices import SELECTION_FILE, KernelSelection, OpChoice
from gimlet_tvm.schedules.tuning.records import target_key
from gimlet_tvm.selection import accepted
from gimlet_tvm.selection.generator import Generator, generate, numpy_expression, task
from gimlet_tvm.selection.json_schema import SCHEMA_FILE, protocol_errors
from gimlet_tvm.selection.search_generator import Config, c_attention, c_conv2d, c_gemm
from gimlet_tvm.selection.select import op_signatures, select_kernels
from gimlet_tvm.selection.verify import out_of_bounds, run_candidate

from .scripted_generator import TVMSCRIPT, kernel
from .test_kernel_selection import K, M, N, WEIGHT_SIG, _matmul_model, encoder_attention, encoder_group

SCRIPT = Path(__file__).with_name("scripted_generator.py")


def scripted(*plans: str) -> str:
    """The shell command of the scripted generator answering round r with plans[r - 1]."""
    return f"{sys.executable} {SCRIPT} {','.join(plans)}"


def _request(target) -> dict:
    return {"signature": WEIGHT_SIG.to_json(), "target": json.loads(str(target)), "external_dir": None,
            "records": None, "min_repeat_ms": 1}


def test_task_matches_the_schema_and_says_what_to_compute():
    """The task of a bias + ReLU GEMM: valid against the shipped schema, with the reference as
    TVMScript and numpy, the C interface with the addend, and the CPU's features."""
    _, target = resolve_target("llvm")
    sig = OpSignature("matmul", ((1, M, K), (K, N)), "float32", (("add", (N,)), ("relu", ())), weight=True)
    made = task(sig, target, 1, 3, None, [])
    assert protocol_errors(made, "task") == []
    assert made["group"]["gemm"] == {"m": M, "n": N, "k": K} and made["group"]["addends"] == [[1, N]]
    assert made["group"]["ops"] == ["matmul", "add", "relu"]
    assert made["reference"]["numpy"] == "np.maximum((a @ b) + addend0, 0)"
    assert "R.nn.relu" in made["reference"]["tvmscript"]
    assert made["formats"] == ["c", "tvmscript"]
    assert "void kernel(const float *a, const float *b, const float *addend0, float *c)" in made["interface"]["c"]
    assert made["target"]["kind"] == "llvm" and made["target"]["features"]
    gelu = OpSignature("matmul", ((M, K), (K, N)), "float32", (("gelu", ()),))
    assert numpy_expression(gelu) == "0.5 * (a @ b) * (1 + erf((a @ b) / np.sqrt(2)))"
    # The schema names what is wrong, where.
    assert protocol_errors(dict(made, round=0), "task") == ["$.round: 0 < 1"]
    assert protocol_errors([{"format": "cuda", "source": "x"}], "candidates") == [
        "$[0].format: 'cuda' is not one of ['c', 'tvmscript']"]
    assert protocol_errors([{"source": ""}], "candidates") == ["$[0]: lacks 'format'",
                                                               "$[0].source: shorter than 1 characters"]
    assert json.loads(SCHEMA_FILE.read_text())["$schema"].startswith("https://json-schema.org/")


CONV_ATTRS = {"stride_h": 2, "stride_w": 1, "pad_top": 1, "pad_left": 2, "pad_bottom": 0, "pad_right": 2,
              "dilation_h": 1, "dilation_w": 2, "groups": 2}
CONV_SIG = OpSignature.from_json({"op": "conv2d", "shapes": [[2, 4, 9, 8], [6, 2, 3, 2]], "dtype": "float32",
                                  "weight": True, "attrs": CONV_ATTRS})


def test_conv2d_groups_are_offered_with_their_sizes_and_reference():
    """A grouped, strided, dilated, unevenly padded conv2d with a bias + ReLU epilogue: offered
    in C and TVMScript, the task valid against the schema, stating its sizes and attributes,
    the C interface with the bias at the output's rank, and a numpy expression that computes
    what the reference does."""
    _, target = resolve_target("llvm")
    sig = dataclasses.replace(CONV_SIG, epilogue=(("add", (6, 1, 1)), ("relu", ())))
    made = task(sig, target, 1, 3, None, [])
    assert protocol_errors(made, "task") == []
    assert made["formats"] == ["c", "tvmscript"] and "gemm" not in made["group"]
    assert made["group"]["conv2d"] == {"n": 2, "c": 4, "h": 9, "w": 8, "o": 6, "kh": 3, "kw": 2, "oh": 4, "ow": 10,
                                       "stride": [2, 1], "pad": [1, 2, 0, 2], "dilation": [1, 2], "groups": 2}
    assert made["group"]["addends"] == [[1, 6, 1, 1]] and made["group"]["layout"].startswith("NCHW data")
    assert ("void kernel(const float *data, const float *weight, const float *addend0, float *out); arrays "
            "data[2][4][9][8], weight[6][2][3][2], addend0[1][6][1][1], out[2][6][4][10]") in made["interface"]["c"]
    rng = np.random.default_rng(11)
    a, b, addend0 = (rng.standard_normal(shape) for shape in (*sig.shapes, *sig.addend_shapes))
    got = eval(made["reference"]["numpy"], {"np": np, "sliding_window_view": sliding_window_view},  # noqa: S307
               {"a": a, "b": b, "addend0": addend0})
    np.testing.assert_allclose(got, sig.reference(a, b, addend0), rtol=1e-12, atol=1e-12)


def _conv_model() -> onnx.ModelProto:
    """One ONNX Conv of `CONV_SIG` (its weight an initializer), no bias."""
    weight = np.random.default_rng(12).standard_normal(CONV_SIG.shapes[1]).astype(np.float32)
    p = CONV_ATTRS
    node = helper.make_node("Conv", ["x", "w"], ["y"], strides=[p["stride_h"], p["stride_w"]],
                            pads=[p["pad_top"], p["pad_left"], p["pad_bottom"], p["pad_right"]],
                            dilations=[p["dilation_h"], p["dilation_w"]], group=p["groups"])
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                             CONV_SIG.shapes[0])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, CONV_SIG.out_shape)],
                              [onnx.numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_generated_conv2d_kernels_are_verified_and_the_right_one_builds(tmp_path):
    """A model's conv2d group offered to a generator: its C kernels checked in the child as
    selection does it, the right one verified (built into the group, against the reference,
    poisoned, against guard pages), one that forgets the padding rejected for reading before
    the start of data; the model built with the right one computes the conv."""
    proto = _conv_model()
    _, target = resolve_target("llvm")
    mod, _ = import_model(proto, {})
    (sig,) = op_signatures(mod, target)
    assert sig == CONV_SIG, sig.key
    tried = []
    request = dict(_request(target), signature=sig.to_json(), generated_dir=str(tmp_path))
    rounds = generate(sig, target, Generator(scripted("conv+convnopad"), rounds=1), str(tmp_path),
                      lambda cid: run_candidate(dict(request, candidate=cid), 120), tried, lambda line: None)
    assert not rounds[0].failure, rounds
    outcomes = {t.id.split(":")[1].split("_")[0]: t for t in tried}
    assert outcomes["conv"].verified, outcomes["conv"].reason
    assert outcomes["convnopad"].verdict == "out-of-bounds access", outcomes["convnopad"].reason
    assert "before the start of data" in outcomes["convnopad"].reason

    selection = KernelSelection(target_key(target), {sig.key: OpChoice(sig, tried, outcomes["conv"].id)},
                                generated_dir=str(tmp_path))
    model = gimlet_tvm.build(proto, "llvm", selection=selection)
    text = model._module.as_text()  # pylint: disable=protected-access
    assert f"generator_{outcomes['conv'].id.split(':')[1]}" in text
    x = np.random.default_rng(13).standard_normal(sig.shapes[0]).astype(np.float32)
    want = sig.reference(x, onnx.numpy_helper.to_array(proto.graph.initializer[0]))
    np.testing.assert_allclose(model(x)[0], want, rtol=1e-4, atol=1e-4)


def _conv_sig(shapes, epilogue=(), stride=(1, 1), pad=(0, 0, 0, 0), dilation=(1, 1), groups=1) -> OpSignature:
    attrs = {"stride_h": stride[0], "stride_w": stride[1], "pad_top": pad[0], "pad_left": pad[1],
             "pad_bottom": pad[2], "pad_right": pad[3], "dilation_h": dilation[0], "dilation_w": dilation[1],
             "groups": groups}
    sig = OpSignature.from_json({"op": "conv2d", "shapes": shapes, "dtype": "float32", "weight": True,
                                 "attrs": attrs})
    return dataclasses.replace(sig, epilogue=tuple(epilogue))


CONV_TEMPLATE_CASES = {
    "3x3 pad 1, bias + ReLU": _conv_sig([[1, 5, 11, 13], [7, 5, 3, 3]], (("add", (7, 1, 1)), ("relu", ())),
                                        pad=(1, 1, 1, 1)),
    "stride 2, uneven pads": _conv_sig([[2, 3, 10, 9], [4, 3, 3, 3]], stride=(2, 2), pad=(1, 0, 0, 1)),
    "dilation 2, groups 2": _conv_sig([[1, 4, 12, 20], [6, 2, 3, 3]], dilation=(2, 2), pad=(2, 2, 2, 2), groups=2),
    "depthwise, residual": _conv_sig([[1, 6, 9, 17], [6, 1, 3, 3]], (("add", (1, 6, 9, 17)),), pad=(1, 1, 1, 1),
                                     groups=6),
    "1x1, GELU": _conv_sig([[1, 9, 5, 40], [3, 9, 1, 1]], (("gelu", ()),)),
}


@pytest.mark.parametrize("case", list(CONV_TEMPLATE_CASES))
def test_search_generator_conv2d_template_computes_the_reference(case, tmp_path):
    """The search generator's direct convolution, compiled as verification compiles it and
    called on its own, at tiles that divide the output and tiles that do not (vector tiles
    inside the image, element by element at its borders, at other strides and in the last
    channels and columns), against the group's reference."""
    sig = CONV_TEMPLATE_CASES[case]
    _, target = resolve_target("llvm")
    group = task(sig, target, 1, 1, None, [])["group"]
    rng = np.random.default_rng(14)
    operands = [rng.standard_normal(shape).astype(np.float32) for _, shape in sig.kernel_operands()[:-1]]
    want = sig.reference(*operands[:2], *operands[2:])
    for config in (Config(1, 1, 4, 1, 1), Config(3, 2, 8, 2, 2), Config(8, 1, 16, 1, 5)):
        source = tmp_path / f"{config.name}.c"
        source.write_text(c_conv2d(config, group))
        kernel_function = ctypes.CDLL(str(shared_library(str(source), target))).kernel
        out = np.full(sig.out_shape, np.nan, np.float32)
        _call_c_kernel(kernel_function, config, [*operands, out])
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4, err_msg=config.name)


def _call_c_kernel(function, config: Config, arrays: list[np.ndarray]) -> None:
    """Call a template's kernel on `arrays` as the build does: each of its tasks in turn."""
    pointers = [x.ctypes.data_as(ctypes.c_void_p) for x in arrays]
    for share in range(config.tasks):
        function(*([ctypes.c_int64(share), ctypes.c_int64(config.tasks)] if config.tasks > 1 else []), *pointers)


GEMM_TEMPLATE_CASES = {
    "bias + ReLU, odd sizes": dataclasses.replace(
        OpSignature.from_json({"op": "matmul", "shapes": [[11, 37], [37, 69]], "dtype": "float32", "weight": True}),
        epilogue=(("add", (69,)), ("relu", ()))),
    "one row (GEMV), GELU": dataclasses.replace(
        OpSignature.from_json({"op": "matmul", "shapes": [[1, 300], [300, 96]], "dtype": "float32", "weight": True}),
        epilogue=(("gelu", ()),)),
}


@pytest.mark.parametrize("case", list(GEMM_TEMPLATE_CASES))
def test_search_generator_gemm_template_computes_the_reference(case, tmp_path):
    """The search generator's GEMM called task by task, at tiles that divide c and tiles that do
    not (rows and columns), K whole and in blocks with a last partial one, against the reference."""
    sig = GEMM_TEMPLATE_CASES[case]
    _, target = resolve_target("llvm")
    group = task(sig, target, 1, 1, None, [])["group"]
    rng = np.random.default_rng(19)
    operands = [rng.standard_normal(shape).astype(np.float32) for _, shape in sig.kernel_operands()[:-1]]
    want = sig.reference(*operands)  # addends as (rows, columns): they broadcast over c alike
    for config in (Config(1, 1, 4, 1, 1), Config(3, 2, 8, 2, 2, 16), Config(8, 4, 16, 4, 3, 64)):
        source = tmp_path / f"{config.name}.c"
        source.write_text(c_gemm(config, group))
        out = np.full(sig.kernel_operands()[-1][1], np.nan, np.float32)
        _call_c_kernel(ctypes.CDLL(str(shared_library(str(source), target))).kernel, config, [*operands, out])
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4, err_msg=config.name)


def _attention_sig(q, k, v, bias=None, scale=0.3) -> OpSignature:
    return OpSignature.from_json({"op": "attention", "shapes": [q, k, v, *([bias] if bias else [])],
                                  "dtype": "float32", "attrs": {"scale": scale}})


ATTENTION_TEMPLATE_CASES = {
    "no bias, odd sizes": _attention_sig([1, 7, 3, 13], [1, 11, 3, 13], [1, 11, 3, 5]),
    "padding mask": _attention_sig([2, 9, 2, 16], [2, 9, 2, 16], [2, 9, 2, 16], [2, 1, 1, 9]),
    "full bias, head 37": _attention_sig([1, 5, 2, 37], [1, 6, 2, 37], [1, 6, 2, 37], [1, 2, 5, 6], 0.125),
}


@pytest.mark.parametrize("case", list(ATTENTION_TEMPLATE_CASES))
def test_search_generator_attention_template_computes_the_reference(case, tmp_path):
    """The search generator's attention, compiled as verification compiles it and called task
    by task, at query tiles that divide the rows and tiles that do not, vectors that divide the
    head and heads with a tail, with and without a (broadcast) bias, against the reference."""
    sig = ATTENTION_TEMPLATE_CASES[case]
    _, target = resolve_target("llvm")
    group = task(sig, target, 1, 1, None, [])["group"]
    rng = np.random.default_rng(18)
    operands = [rng.standard_normal(shape).astype(np.float32) for _, shape in sig.kernel_operands()[:-1]]
    want = sig.reference(*operands)
    for config in (Config(1, 1, 4, 1, 1), Config(3, 1, 8, 2, 2), Config(8, 1, 16, 4, 3)):
        source = tmp_path / f"{config.name}.c"
        source.write_text(c_attention(config, group))
        out = np.full(sig.out_shape, np.nan, np.float32)
        _call_c_kernel(ctypes.CDLL(str(shared_library(str(source), target))).kernel, config, [*operands, out])
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5, err_msg=config.name)


def test_search_generator_answers_attention_with_a_verified_kernel(tmp_path):
    """The bundled search's first kernel for the encoder's attention (with its padding-mask
    bias) passes verification: reference, NaN/Inf, poisons, guard pages, task orders."""
    _, _, _, _, attention = encoder_attention()
    _, target = resolve_target("llvm")
    request = dict(_request(target), signature=attention.to_json(), generated_dir=str(tmp_path))
    tried = []
    rounds = generate(attention, target, Generator.named("search", rounds=1, seconds=60), str(tmp_path),
                      lambda cid: run_candidate(dict(request, candidate=cid), 120), tried, lambda line: None)
    assert not rounds[0].failure and len(tried) == 1, rounds
    assert tried[0].verified, tried[0].reason


@pytest.mark.slow  # ~60 s; the template's results are checked in CI by the test above
def test_search_generator_answers_conv2d_groups_with_verified_kernels(tmp_path):
    """The bundled search on a model's grouped, strided, dilated conv2d: every kernel it
    proposes in two rounds passes verification (guard pages and poisons included), and the
    model built with the fastest computes the conv."""
    proto = _conv_model()
    _, target = resolve_target("llvm")
    mod, _ = import_model(proto, {})
    (sig,) = op_signatures(mod, target)
    directory = str(tmp_path / "kernels")
    request = dict(_request(target), signature=sig.to_json(), generated_dir=directory)
    tried = []
    rounds = generate(sig, target, Generator.named("search", rounds=2, seconds=60), directory,
                      lambda cid: run_candidate(dict(request, candidate=cid), 120), tried, lambda line: None)
    assert not any(r.failure for r in rounds) and len(tried) > 1, rounds
    assert all(t.verified for t in tried), [(t.id, t.reason) for t in tried if not t.verified]
    winner = min(tried, key=lambda t: t.seconds)
    selection = KernelSelection(target_key(target), {sig.key: OpChoice(sig, tried, winner.id)},
                                generated_dir=directory)
    model = gimlet_tvm.build(proto, "llvm", selection=selection)
    x = np.random.default_rng(15).standard_normal(sig.shapes[0]).astype(np.float32)
    want = sig.reference(x, onnx.numpy_helper.to_array(proto.graph.initializer[0]))
    np.testing.assert_allclose(model(x)[0], want, rtol=1e-4, atol=1e-4)


def test_attention_groups_are_offered_and_a_generated_attention_builds(tmp_path):
    """The encoder's attention (with its padding-mask bias) offered to a generator: the task
    states its sizes, scale and bias, the C interface names q, k, v, bias and out, and its
    numpy expression computes the reference; of two C kernels the right one is verified and
    the one that forgets the scale is a wrong result; the model built with the right one
    computes what onnxruntime does."""
    proto, inputs, shapes, _, sig = encoder_attention()
    _, target = resolve_target("llvm")
    made = task(sig, target, 1, 1, None, [])
    assert protocol_errors(made, "task") == [] and made["formats"] == ["c", "tvmscript"]
    assert made["group"]["attention"] == {"b": 1, "s": 64, "t": 64, "n": 4, "h": 64, "hv": 64, "scale": 0.125,
                                          "bias": [1, 1, 1, 64]}
    assert ("void kernel(const float *q, const float *k, const float *v, const float *bias, float *out); "
            "arrays q[1][64][4][64], k[1][64][4][64], v[1][64][4][64], bias[1][1][1][64], out[1][64][4][64]"
            ) in made["interface"]["c"]
    operands = [np.random.default_rng(16).standard_normal(shape) for shape in sig.shapes]
    got = eval(made["reference"]["numpy"], {"np": np}, dict(zip(("q", "k", "v", "bias"), operands)))  # noqa: S307
    np.testing.assert_allclose(got, sig.reference(*operands), rtol=1e-12, atol=1e-12)

    directory = str(tmp_path)
    request = dict(_request(target), signature=sig.to_json(), generated_dir=directory)
    tried = []
    rounds = generate(sig, target, Generator(scripted("attention+attentionnoscale"), rounds=1), directory,
                      lambda cid: run_candidate(dict(request, candidate=cid), 120), tried, lambda line: None)
    assert not rounds[0].failure, rounds
    outcomes = {t.id.split(":")[1].split("_")[0]: t for t in tried}
    assert outcomes["attention"].verified, outcomes["attention"].reason
    assert outcomes["attentionnoscale"].verdict == "wrong result", outcomes["attentionnoscale"].reason
    selection = KernelSelection(target_key(target), {sig.key: OpChoice(sig, tried, outcomes["attention"].id)},
                                generated_dir=directory)
    model = gimlet_tvm.build(proto, "llvm", input_shapes=shapes, selection=selection)
    assert f"generator_{outcomes['attention'].id.split(':')[1]}" in model._module.as_text()  # pylint: disable=protected-access
    ok, diff = check_against_onnxruntime(proto, model, inputs, tolerance=1e-4)
    assert ok, diff


def _generated_norms(sig: OpSignature, plans: str, directory: str) -> tuple[dict, list]:
    """One round of the scripted generator's `plans` on `sig`, each kernel verified: its
    outcomes by plan, and all of them as tried."""
    _, target = resolve_target("llvm")
    request = dict(_request(target), signature=sig.to_json(), generated_dir=directory)
    tried = []
    rounds = generate(sig, target, Generator(scripted(plans), rounds=1), directory,
                      lambda cid: run_candidate(dict(request, candidate=cid), 120), tried, lambda line: None)
    assert not rounds[0].failure, rounds
    return {t.id.split(":")[1].split("_")[0]: t for t in tried}, tried


def test_layer_norm_groups_are_offered_and_a_generated_layer_norm_builds(tmp_path):
    """The encoder's LayerNorm offered to a generator: the task states its rows, size, axes
    and epsilon, the C interface names x, gamma, beta and out, and its numpy expression
    computes the reference; a right C layer norm is verified (one that divides the variance
    by size - 1 is a wrong result), and the model built with it (in place of both of the
    encoder's LayerNorms) computes what onnxruntime does."""
    proto, inputs, shapes, _, sig = encoder_group("layer_norm")
    _, target = resolve_target("llvm")
    made = task(sig, target, 1, 1, None, [])
    assert protocol_errors(made, "task") == [] and made["formats"] == ["c", "tvmscript"]
    assert made["group"]["layer_norm"] == {"rows": 64, "size": 256, "axes": 1, "epsilon": pytest.approx(1e-5)}
    assert ("void kernel(const float *x, const float *gamma, const float *beta, float *out); "
            "arrays x[64][256], gamma[256], beta[256], out[64][256]") in made["interface"]["c"]
    operands = [np.random.default_rng(17).standard_normal(shape) for shape in sig.shapes]
    got = eval(made["reference"]["numpy"], {"np": np}, dict(zip(("x", "gamma", "beta"), operands)))  # noqa: S307
    np.testing.assert_allclose(got, sig.reference(*operands), rtol=1e-12, atol=1e-12)
    assert protocol_errors(dict(made, group=dict(made["group"], layer_norm={"rows": 64})), "task") == [
        "$.group.layer_norm: lacks 'size'", "$.group.layer_norm: lacks 'axes'", "$.group.layer_norm: lacks 'epsilon'"]

    outcomes, tried = _generated_norms(sig, "norm+normunbiased", str(tmp_path))
    assert outcomes["norm"].verified, outcomes["norm"].reason
    assert outcomes["normunbiased"].verdict == "wrong result" and "on random inputs" in outcomes["normunbiased"].reason
    selection = KernelSelection(target_key(target), {sig.key: OpChoice(sig, tried, outcomes["norm"].id)},
                                generated_dir=str(tmp_path))
    model = gimlet_tvm.build(proto, "llvm", input_shapes=shapes, selection=selection)
    assert f"generator_{outcomes['norm'].id.split(':')[1]}" in model._module.as_text()  # pylint: disable=protected-access
    ok, diff = check_against_onnxruntime(proto, model, inputs, tolerance=1e-4)
    assert ok, diff


def test_wrong_layer_norms_are_rejected_with_their_reason(tmp_path):
    """C layer norms for the encoder's LayerNorm that forget epsilon (NaN on zero rows), take
    the variance as E[x^2] - E[x]^2 in float32 (off on rows far from 0) or read one element
    past gamma are each rejected for what they do."""
    _, _, _, _, sig = encoder_group("layer_norm")
    outcomes, _ = _generated_norms(sig, "normnoeps+normonepass+normoob", str(tmp_path))
    assert outcomes["normnoeps"].verdict == "wrong result"
    assert "on zeros inputs: max abs error nan" in outcomes["normnoeps"].reason
    assert outcomes["normonepass"].verdict == "wrong result"
    assert "on offset-rows inputs" in outcomes["normonepass"].reason
    assert outcomes["normoob"].verdict == "out-of-bounds access"
    assert outcomes["normoob"].reason.endswith("past the end of gamma (or writes this input)")


def _rms_norm_model() -> onnx.ModelProto:
    """One opset-23 RMSNormalization over the last two axes of x[3, 6, 40], its scale an
    initializer."""
    scale = np.random.default_rng(18).uniform(0.5, 1.5, (6, 40)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("RMSNormalization", ["x", "scale"], ["y"], axis=-2, epsilon=1e-6)], "rms_norm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 6, 40])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6, 40])],
        [onnx.numpy_helper.from_array(scale, "scale")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def test_select_with_a_generator_races_its_rms_norm_against_generated_code(tmp_path):
    """An RMSNormalization over two axes is an op group (x folded to [3, 240] for a kernel):
    `select` verifies the generated TIR and the generator's C RMS norm and stores the faster
    (raced where they are close); the model built with the selection computes what
    onnxruntime does, with the generator's kernel in it where it won."""
    proto = _rms_norm_model()
    _, target = resolve_target("llvm")
    mod, _ = import_model(proto, {})
    (sig,) = op_signatures(mod, target)
    assert sig.key == "rms_norm float32 3x6x40 6x40 epsilon=1e-06"
    assert [name for name, _ in sig.kernel_operands()] == ["x", "gamma", "out"]
    made = task(sig, target, 1, 1, None, [])
    assert protocol_errors(made, "task") == [] and made["group"]["rms_norm"]["axes"] == 2
    assert "void kernel(const float *x, const float *gamma, float *out); arrays x[3][240], gamma[240]" in \
        made["interface"]["c"]
    selection = select_kernels(mod, target, records=str(tmp_path), timeout=120, min_repeat_ms=1,
                               generator=Generator(scripted("norm"), rounds=1))
    choice = selection.choices[sig.key]
    assert [t.id.split("_")[0] for t in choice.tried] == ["generated:tir", "generator:norm"]
    assert all(t.verified for t in choice.tried), [t.reason for t in choice.tried]
    assert choice.winner == min(choice.tried, key=lambda t: t.seconds).id or all(t.rounds for t in choice.tried)
    model = gimlet_tvm.build(proto, "llvm", records=str(tmp_path), selection=selection)
    assert (choice.winner.startswith("generator:")) == ("generator_norm" in model._module.as_text())  # pylint: disable=protected-access
    x = {"x": np.random.default_rng(19).standard_normal((3, 6, 40)).astype(np.float32) * 5 + 2}
    ok, diff = check_against_onnxruntime(proto, model, x, tolerance=1e-4)
    assert ok, diff


def test_generator_rounds_get_feedback_and_failed_rounds_go_on(tmp_path, monkeypatch):
    """Six rounds: a right and a wrong C kernel (verified, and rejected as a wrong result);
    output that is no JSON; JSON that is no candidate list; a non-zero exit; the right kernel
    again (not verified twice) with a TVMScript one; a generator that hangs (killed at the
    group's time). Each later task carries the history and the best so far."""
    _, target = resolve_target("llvm")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    monkeypatch.setenv("GIMLET_TEST_TASKS", str(tasks))
    generator = Generator(scripted("good+wrong", "malformed", "notlist", "exit", "good+tvmscript", "hang"),
                          rounds=6, seconds=5)
    tried, lines, verified = [], [], []

    def verify(cid):
        verified.append(cid)
        return run_candidate(dict(_request(target), candidate=cid, generated_dir=str(tmp_path / "kernels")), 120)

    rounds = generate(WEIGHT_SIG, target, generator, str(tmp_path / "kernels"), verify, tried, lines.append)
    assert [r.round for r in rounds] == [1, 2, 3, 4, 5, 6]
    good, wrong = rounds[0].candidates
    assert re.fullmatch(r"generator:good_[0-9a-f]{12}", good) and wrong.startswith("generator:wrong_")
    outcomes = {t.id: t for t in tried}
    assert outcomes[good].verified and outcomes[good].verdict == "ok" and outcomes[good].seconds > 0
    assert outcomes[wrong].verdict == "wrong result" and "max abs error 1 >" in outcomes[wrong].reason
    assert rounds[1].failure.startswith("malformed output (not JSON")
    assert rounds[2].failure == "malformed output: $: expected array, got dict"
    assert rounds[3].failure == "exited with code 3: generator gave up"
    assert rounds[4].candidates[0] == good and not rounds[4].failure
    assert outcomes[rounds[4].candidates[1]].verified  # the TVMScript GEMM
    assert rounds[5].failure.startswith("timed out after") and rounds[5].seconds < 5
    assert len(verified) == 3 == len(tried)  # the repeated kernel was not verified again
    assert any("generator round 4 failed: exited with code 3" in line for line in lines)

    saved = {int(p.stem[5:]): json.loads(p.read_text()) for p in tasks.glob("round*.json")}
    assert sorted(saved) == [1, 2, 3, 4, 5, 6]
    assert all(protocol_errors(t, "task") == [] for t in saved.values())
    assert saved[1]["best"] is None and saved[1]["history"] == []
    (first,) = saved[2]["history"]
    assert [(a["verdict"], a["format"]) for a in first["attempts"]] == [("ok", "c"), ("wrong result", "c")]
    assert saved[2]["best"]["candidate"] == good and "void kernel" in saved[2]["best"]["source"]
    assert [h["failure"][:16] for h in saved[6]["history"]] == ["", "malformed output", "malformed output",
                                                                 "exited with code", ""]


def test_generator_answers_only_in_the_formats_offered(tmp_path):
    """C is offered for float32 GEMMs only: C kernels for a float16 GEMM fail the round, and
    nothing is built or verified."""
    _, target = resolve_target("llvm")
    half = OpSignature("matmul", ((M, K), (K, N)), "float16", weight=True)
    assert task(half, target, 1, 1, None, [])["formats"] == ["tvmscript"]
    tried = []
    rounds = generate(half, target, Generator(scripted("good")), str(tmp_path), lambda cid: pytest.fail(cid),
                      tried, lambda line: None)
    assert rounds[0].failure == "format 'c' is not accepted here (only tvmscript)" and not tried
    with pytest.raises(GimletError, match="at least one round"):
        Generator("true", rounds=0)


@pytest.mark.slow  # about 140 s on 2 shared cores: every standard candidate is verified and raced too
def test_select_with_a_generator_builds_its_winner(cli, tmp_path):
    """`gimlet-tvm select --generator`: the generator's kernels are tried beside the others,
    listed with their verdicts and rounds in the table and the records, and a build restricted
    to the generator's kernels runs its winner."""
    model_path = tmp_path / "matmul.onnx"
    onnx.save(_matmul_model(), model_path)
    records = tmp_path / "records"
    code, out, err = cli("select", str(model_path), "--records", str(records), "--input-shape", f"x={M},{K}",
                         "--generator", scripted("wrong", "good"), "--rounds", "2", "--per-group-seconds", "60")
    assert code == 0, err
    assert re.search(r"generator:wrong_\w+ +no: wrong result at", out), out
    assert re.search(r"generator:good_\w+ +yes +[0-9.]+", out), out
    assert re.search(r"generator round 1 \([0-9.]+ s\): 1 candidates", out), out
    stored = json.loads((records / SELECTION_FILE).read_text())
    (choice,) = next(iter(stored["targets"].values()))["ops"].values()
    assert [len(r["candidates"]) for r in choice["generator_rounds"]] == [1, 1]
    verdicts = {t["id"].split("_")[0]: t["verdict"] for t in choice["tried"] if t["id"].startswith("generator:")}
    assert verdicts == {"generator:wrong": "wrong result", "generator:good": "ok"}
    assert (records / "generated_kernels" / "kernels.json").is_file()

    _, target = resolve_target("llvm")
    only_generated = KernelSelection.load(records, target).restricted_to("generator")
    assert next(iter(only_generated.choices.values())).winner.startswith("generator:good_")
    model = gimlet_tvm.build(model_path, "llvm", input_shapes={"x": [M, K]}, selection=only_generated)
    x = np.random.default_rng(8).standard_normal((M, K)).astype(np.float32)
    want = x @ onnx.numpy_helper.to_array(_matmul_model().graph.initializer[0])
    np.testing.assert_allclose(model(x)[0], want, rtol=1e-4, atol=1e-4)


def _linear_relu_model(m: int, k: int, n: int) -> onnx.ModelProto:
    """x @ w + bias, then ReLU: one GEMM op group with a bias + ReLU epilogue."""
    rng = np.random.default_rng(9)
    inits = [onnx.numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), name)
             for name, s in (("w", (k, n)), ("bias", (n,)))]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "bias"], ["z"]),
             helper.make_node("Relu", ["z"], ["y"])]
    graph = helper.make_graph(nodes, "linear_relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _search_improves_and_builds(proto: onnx.ModelProto, sig: OpSignature, target, directory: str,
                                rounds: int) -> gimlet_tvm.CompiledModel:
    """`rounds` rounds of the bundled search on the model's op group `sig`: nothing proposed
    twice, every kernel verified, the later rounds' fastest faster than the first's; the model
    built with the winner (its kernel in the module)."""
    request = dict(_request(target), signature=sig.to_json(), generated_dir=directory)
    tried = []
    done = generate(sig, target, Generator.named("search", rounds=rounds, seconds=60), directory,
                    lambda cid: run_candidate(dict(request, candidate=cid), 120), tried, lambda line: None)
    assert not any(r.failure for r in done), done
    outcomes = {t.id: t for t in tried}
    names = [cid for r in done for cid in r.candidates]
    assert len(names) == len(set(names)) == len(tried)  # nothing proposed twice
    assert all(t.verified for t in tried), [(t.id, t.reason) for t in tried if not t.verified]
    first = min(outcomes[cid].seconds for cid in done[0].candidates)
    later = min(outcomes[cid].seconds for r in done[1:] for cid in r.candidates)
    assert later < first, (first, later)
    winner = min(tried, key=lambda t: t.seconds)
    selection = KernelSelection(target_key(target), {sig.key: OpChoice(sig, tried, winner.id)},
                                generated_dir=directory)
    model = gimlet_tvm.build(proto, "llvm", selection=selection)
    assert f"generator_{winner.id.split(':')[1]}" in model._module.as_text()  # pylint: disable=protected-access
    return model


@pytest.mark.slow  # about 100 s on 2 shared cores: five kernels verified and timed, one model built
def test_search_generator_improves_on_its_first_round_and_its_winner_builds(tmp_path):
    """The bundled search over the C GEMM template, on a linear layer + ReLU: its later rounds
    (neighbours of its fastest verified kernel, nothing tried twice) beat its first, and the
    model built with its winner computes what numpy does."""
    m, k, n = 48, 128, 128
    proto = _linear_relu_model(m, k, n)
    _, target = resolve_target("llvm")
    mod, _ = import_model(proto, {})
    (sig,) = op_signatures(mod, target)
    assert [kind for kind, _ in sig.epilogue] == ["add", "relu"]
    model = _search_improves_and_builds(proto, sig, target, str(tmp_path / "kernels"), rounds=2)
    x = np.random.default_rng(10).standard_normal((m, k)).astype(np.float32)
    w, bias = (onnx.numpy_helper.to_array(init) for init in proto.graph.initializer)
    np.testing.assert_allclose(model(x)[0], np.maximum(x @ w + bias, 0), rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # about 120 s on 2 shared cores: nine kernels verified and timed, one model built
def test_search_generator_improves_on_its_first_round_for_a_conv_and_its_winner_builds(tmp_path):
    """The bundled search over the direct convolution template, on a grouped 3x3 conv with bias
    and ReLU (the CPU library runs it on unfolded patches; a groups-1 conv of this size goes to
    its direct kernel, which selection does not see as a group yet): its later rounds beat its
    first, and the model built with its winner computes the conv as onnxruntime does."""
    rng = np.random.default_rng(20)
    weight, bias = rng.standard_normal((32, 8, 3, 3)).astype(np.float32), rng.standard_normal(32).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["z"], pads=[1, 1, 1, 1], group=2),
         helper.make_node("Relu", ["z"], ["y"])],
        "conv_relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 28, 28])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 28, 28])],
        [onnx.numpy_helper.from_array(weight, "w"), onnx.numpy_helper.from_array(bias, "b")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    _, target = resolve_target("llvm")
    mod, _ = import_model(proto, {})
    (sig,) = op_signatures(mod, target)
    assert sig.op == "conv2d" and [kind for kind, _ in sig.epilogue] == ["add", "relu"], sig.key
    model = _search_improves_and_builds(proto, sig, target, str(tmp_path / "kernels"), rounds=3)
    ok, diff = check_against_onnxruntime(proto, model, {"x": rng.standard_normal((1, 16, 28, 28)).astype(np.float32)},
                                         tolerance=1e-4)
    assert ok, diff


def _verify_in(directory: Path, target, timeout: float):
    request = dict(_request(target), generated_dir=str(directory))
    return lambda cid: run_candidate(dict(request, candidate=cid), timeout)


def test_accepted_kernels_are_cached_by_content_with_their_provenance(tmp_path, monkeypatch):
    """Selecting again with the same generator answer: the kernel accepted the first time is not
    verified again (reported cached, its time from then), the wrong one is; the cache keeps the
    generator, the round and the checks passed, and a verifier with other checks misses it."""
    _, target = resolve_target("llvm")
    directory = tmp_path / "kernels"
    verified, lines = [], []

    def verify(cid):
        verified.append(cid)
        return _verify_in(directory, target, 120)(cid)

    runs = []
    for _ in range(2):
        tried = []
        generate(WEIGHT_SIG, target, Generator(scripted("good+wrong"), rounds=1), str(directory), verify, tried,
                 lines.append)
        runs.append({t.id.split(":")[1].split("_")[0]: t for t in tried})
    first, second = runs
    assert [cid.split(":")[1].split("_")[0] for cid in verified] == ["good", "wrong", "wrong"]
    assert first["good"].verified and not first["good"].cached
    assert second["good"].verified and second["good"].cached and second["good"].seconds == first["good"].seconds
    assert second["wrong"].verdict == "wrong result" and not second["wrong"].cached
    assert any(f"{second['good'].id} (round 1) cached, verified before: " in line for line in lines), lines
    (entry,) = json.loads((directory / accepted.CACHE_FILE).read_text())["kernels"].values()
    assert entry["name"] == first["good"].id.split(":")[1] and entry["round"] == 1
    assert entry["generator"] == scripted("good+wrong") and entry["checks"] == list(accepted.KERNEL_CHECKS)
    assert entry["shapes_checked"] == [WEIGHT_SIG.key]
    source = (directory / f"{entry['name']}.c").read_text()
    digest = accepted.content_hash(WEIGHT_SIG, target, "c", source)
    assert accepted.AcceptedKernels(str(directory)).get(digest) == entry
    monkeypatch.setattr(accepted, "KERNEL_CHECKS", ("fewer checks",))
    assert accepted.content_hash(WEIGHT_SIG, target, "c", source) != digest


def test_unsafe_and_wrong_generated_kernels_are_rejected_with_their_reason(tmp_path):
    """One round of a right kernel, one that never writes its first output element and one that
    calls fork(): each bad one rejected with its own reason (the fork before it is ever run),
    and only the right one verified. (One off by one element: the rounds test above.)"""
    _, target = resolve_target("llvm")
    tried = []
    generate(WEIGHT_SIG, target, Generator(scripted("good+uninit+fork"), rounds=1), str(tmp_path),
             _verify_in(tmp_path, target, 120), tried, lambda line: None)
    outcomes = {t.id.split(":")[1].split("_")[0]: t for t in tried}
    assert outcomes["good"].verified and outcomes["good"].verdict == "ok"
    assert outcomes["uninit"].verdict == "uninitialised output"
    assert "1 of 200 elements keep what the output buffer held (first at (0, 0))" in outcomes["uninit"].reason
    assert outcomes["fork"].verdict == "unsafe" and "calls fork: a kernel may call" in outcomes["fork"].reason
    assert [t.id for t in tried if t.verified] == [outcomes["good"].id]


def test_c_kernels_split_into_tasks_run_in_parallel_and_races_are_rejected(tmp_path):
    """A C GEMM in 3 tasks (rows split between them) is verified, and the model built with it
    calls it in a parallel loop and computes the matmul; one splitting K instead, each task
    adding its part into c after task 0 zeroed it, is rejected as a race (its output depends
    on the order of its tasks)."""
    _, target = resolve_target("llvm")
    tried = []
    rounds = generate(WEIGHT_SIG, target, Generator(scripted("tasks+splitk"), rounds=1), str(tmp_path),
                      _verify_in(tmp_path, target, 120), tried, lambda line: None)
    assert not rounds[0].failure, rounds
    outcomes = {t.id.split(":")[1].split("_")[0]: t for t in tried}
    assert outcomes["tasks"].verified, outcomes["tasks"].reason
    assert outcomes["splitk"].verdict == "race", outcomes["splitk"].reason
    assert "differ between its 3 tasks run concurrently, in order and in reverse order" in outcomes["splitk"].reason

    candidate = find(outcomes["tasks"].id, WEIGHT_SIG, target, generated_dir=str(tmp_path))
    assert candidate.c_source.tasks == 3 and "in T.parallel(T.int64(3))" in candidate.kernel(WEIGHT_SIG).script()
    selection = KernelSelection(target_key(target), {WEIGHT_SIG.key: OpChoice(WEIGHT_SIG, tried,
                                                                              outcomes["tasks"].id)},
                                generated_dir=str(tmp_path))
    proto = _matmul_model()
    model = gimlet_tvm.build(proto, "llvm", input_shapes={"x": [M, K]}, selection=selection)
    assert f"generator_{outcomes['tasks'].id.split(':')[1]}" in model._module.as_text()  # pylint: disable=protected-access
    x = np.random.default_rng(16).standard_normal((M, K)).astype(np.float32)
    np.testing.assert_allclose(model(x)[0], x @ onnx.numpy_helper.to_array(proto.graph.initializer[0]),
                               rtol=1e-4, atol=1e-4)


def test_gpu_targets_take_tvmscript_kernels_checked_on_the_device(tmp_path):
    """On Vulkan (lavapipe here) a generator is offered TVMScript alone and told to bind its
    threads; a thread-bound GEMM is verified on the device (the poisoned runs there too;
    guard pages are host memory, skipped) and a model built for Vulkan with it computes the
    matmul, while one that never zeroes its output keeps the poison ("uninitialised output").
    For CUDA, with no GPU here, the same kernel compiles and is reported as unable to run."""
    _, target = resolve_target("vulkan")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    tried = []
    os.environ["GIMLET_TEST_TASKS"] = str(tasks)
    try:
        generate(WEIGHT_SIG, target, Generator(scripted("gpu+gpunozero"), rounds=1), str(tmp_path),
                 _verify_in(tmp_path, target, 300), tried, lambda line: None)
    finally:
        del os.environ["GIMLET_TEST_TASKS"]
    offered = json.loads((tasks / "round1.json").read_text())
    assert offered["formats"] == ["tvmscript"] and "T.thread_binding" in offered["interface"]["tvmscript"]
    outcomes = {t.id.split(":")[1].split("_")[0]: t for t in tried}
    assert outcomes["gpu"].verified, outcomes["gpu"].reason
    assert outcomes["gpunozero"].verdict == "uninitialised output", outcomes["gpunozero"].reason

    selection = KernelSelection(target_key(target), {WEIGHT_SIG.key: OpChoice(WEIGHT_SIG, tried, outcomes["gpu"].id)},
                                generated_dir=str(tmp_path))
    proto = _matmul_model()
    model = gimlet_tvm.build(proto, "vulkan", input_shapes={"x": [M, K]}, selection=selection)
    x = np.random.default_rng(17).standard_normal((M, K)).astype(np.float32)
    np.testing.assert_allclose(model(x)[0], x @ onnx.numpy_helper.to_array(proto.graph.initializer[0]),
                               rtol=1e-4, atol=1e-4)

    _, cuda = resolve_target("cuda")
    name = add_kernel(str(tmp_path), WEIGHT_SIG, "cuda", "tvmscript", kernel("gpu", offered["group"]["gemm"])["source"],
                      "gpu")
    outcome = _verify_in(tmp_path, cuda, 300)(f"generator:{name}")
    assert outcome.verdict == "cannot run" and outcome.reason.startswith("compiled; cannot run on this machine"), outcome


def test_a_generator_may_split_only_c_kernels_into_tasks_and_at_most_max_tasks():
    """The protocol's `tasks`: an integer from 1 to MAX_TASKS, checked against the schema."""
    assert not protocol_errors([{"format": "c", "source": "x", "tasks": MAX_TASKS}], "candidates")
    for tasks in (0, MAX_TASKS + 1, 2.5):
        assert protocol_errors([{"format": "c", "source": "x", "tasks": tasks}], "candidates"), tasks


def test_guard_pages_catch_accesses_out_of_bounds_and_name_the_operand(tmp_path):
    """C kernels called on their own, each operand against a guard page: one element read past
    the end of b, written past the end of c, read before the start of a; one writing far from
    every operand crashes without them too (a crash); the right one passes."""
    from .scripted_generator import kernel

    _, target = resolve_target("llvm")
    found = {}
    for plan in ("good", "oob", "oobwrite", "before", "stray"):
        source = kernel(plan, {"m": M, "n": N, "k": K})["source"]
        name = add_kernel(str(tmp_path), WEIGHT_SIG, "llvm", "c", source, plan)
        candidate = find(f"generator:{name}", WEIGHT_SIG, target, generated_dir=str(tmp_path))
        found[plan] = out_of_bounds(WEIGHT_SIG, candidate.c_source, target)
    assert found["good"] is None
    assert {found[plan].verdict for plan in ("oob", "oobwrite", "before")} == {"out-of-bounds access"}
    assert found["oob"].reason.endswith("faults with each operand against a guard page, past the end of b "
                                        "(or writes this input)"), found["oob"].reason
    assert found["oobwrite"].reason.endswith("past the end of c"), found["oobwrite"].reason
    assert "before the start of a" in found["before"].reason, found["before"].reason
    assert found["stray"].verdict == "crash" and found["stray"].reason.startswith("crashed (SIGSEGV) at matmul")


def test_generated_kernel_that_never_returns_is_rejected_as_a_timeout(tmp_path):
    """An endless loop is killed at the candidate's time (with its process group)."""
    _, target = resolve_target("llvm")
    tried = []
    generate(WEIGHT_SIG, target, Generator(scripted("loop"), rounds=1), str(tmp_path),
             _verify_in(tmp_path, target, 30), tried, lambda line: None)
    (loop,) = tried
    assert loop.verdict == "timeout" and loop.reason.startswith("timed out after 30 s"), loop.reason


def test_kernel_that_does_not_propagate_nan_is_rejected(tmp_path):
    """A TVMScript GEMM that clamps its output at +-1e30 (so NaN becomes a number and Inf a
    finite value) passes the random inputs but not the NaN/Inf ones."""
    _, target = resolve_target("llvm")
    clamped = TVMSCRIPT_CLAMPED.format(m=M, k=K, n=N)
    name = add_kernel(str(tmp_path), WEIGHT_SIG, "llvm", "tvmscript", clamped, "clamped")
    outcome = _verify_in(tmp_path, target, 120)(f"generator:{name}")
    assert outcome.verdict == "wrong result" and "on NaN/Inf inputs" in outcome.reason, outcome.reason


def test_tvmscript_kernel_reading_past_the_end_is_rejected(tmp_path):
    """A TVMScript GEMM that reads one element past the end of b (whose size is a multiple of
    64 bytes, so it ends exactly at the guard page, DLPack's alignment notwithstanding) faults
    there, in the child: an out-of-bounds access, not a crash."""
    _, target = resolve_target("llvm")
    assert K * N * 4 % 64 == 0
    name = add_kernel(str(tmp_path), WEIGHT_SIG, "llvm", "tvmscript", TVMSCRIPT_PAST_END.format(m=M, k=K, n=N),
                      "past_end")
    outcome = _verify_in(tmp_path, target, 120)(f"generator:{name}")
    assert outcome.verdict == "out-of-bounds access", outcome.reason
    assert outcome.reason.startswith(f"out-of-bounds access at {WEIGHT_SIG.key}: SIGSEGV with each operand")


def test_tvmscript_kernel_calling_outside_functions_is_unsafe(tmp_path):
    """TVMScript may call libm (expf) but not, say, system()."""
    _, target = resolve_target("llvm")
    calls = TVMSCRIPT_CALLING.format(m=M, k=K, n=N)
    name = add_kernel(str(tmp_path), WEIGHT_SIG, "llvm", "tvmscript", calls, "calls")
    with pytest.raises(UnsafeKernelError, match="calls system: a kernel may call"):
        find(f"generator:{name}", WEIGHT_SIG, target, generated_dir=str(tmp_path)).kernel(WEIGHT_SIG)


# The scripted generator's GEMM, its result clamped (a different kernel doing the same work).
TVMSCRIPT_CLAMPED = TVMSCRIPT.rstrip("\n") + "\n        c[i, j] = T.min(T.max(c[i, j], T.float32(-1e30)), T.float32(1e30))\n"
# The same GEMM then reading one row past the end of b (a value that cannot change the result).
TVMSCRIPT_PAST_END = TVMSCRIPT.rstrip("\n") + "\n    c[0, 0] = T.max(c[0, 0], T.min(c[0, 0], b[{k}, 0]))\n"
TVMSCRIPT_CALLING = """
# from tvm.script import tirx as T

@T.prim_func
def gemm(a: T.Buffer(({m}, {k}), "float32"), b: T.Buffer(({k}, {n}), "float32"),
         c: T.Buffer(({m}, {n}), "float32")):
    T.func_attr({{"tir.noalias": True, "tirx.is_scheduled": True}})
    for i, j in T.grid({m}, {n}):
        c[i, j] = T.call_pure_extern("float32", "expf", T.float32(0))
        T.evaluate(T.call_extern("int32", "system", "true"))
"""


class _FakeEndpoint(http.server.BaseHTTPRequestHandler):
    """A chat-completions endpoint replaying `replies` in turn; `requests` keeps what it got."""

    replies: list[str] = []
    requests: list[tuple[str, str | None, dict]] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append((self.path, self.headers.get("Authorization"), body))
        reply = self.replies[len(self.requests) - 1]
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # quiet
        pass


def test_openai_adapter_gets_the_task_and_its_bad_kernels_are_rejected(tmp_path, monkeypatch):
    """The bundled adapter against a fake endpoint on 127.0.0.1: it sends the task with the key;
    the endpoint's wrong, uninitialised-output, forking and out-of-bounds-reading kernels (in a
    ```json block) are rejected with their reasons, a reply with no JSON is a failed round, and its right kernel
    (bare JSON) is verified."""
    gemm = {"m": M, "n": N, "k": K}
    handler = type("Endpoint", (_FakeEndpoint,), {"requests": [], "replies": [
        "Here are four:\n```json\n" + json.dumps([kernel(p, gemm) for p in ("wrong", "uninit", "fork", "oob")])
        + "\n```",
        "I am sorry, I cannot write kernels.",
        json.dumps([kernel("good", gemm)])]})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("FAKE_KEY", "test-key")
    try:
        _, target = resolve_target("llvm")
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        generator = Generator.named(f"openai --url {url} --model fake-coder --key-env FAKE_KEY", rounds=3, seconds=60)
        tried = []
        rounds = generate(WEIGHT_SIG, target, generator, str(tmp_path), _verify_in(tmp_path, target, 120), tried,
                          lambda line: None)
    finally:
        server.shutdown()
    assert handler.requests, rounds
    path, auth, body = handler.requests[0]
    assert path == "/v1/chat/completions" and auth == "Bearer test-key" and body["model"] == "fake-coder"
    sent = json.loads(body["messages"][1]["content"])
    assert sent["group"]["key"] == WEIGHT_SIG.key and sent["round"] == 1 and protocol_errors(sent, "task") == []
    later = json.loads(handler.requests[2][2]["messages"][1]["content"])
    assert [a["verdict"] for a in later["history"][0]["attempts"]] == ["wrong result", "uninitialised output",
                                                                      "unsafe", "out-of-bounds access"]
    assert rounds[1].failure.startswith("malformed output (not JSON")
    verdicts = {t.id.split(":")[1].split("_")[0]: t.verdict for t in tried}
    assert verdicts == {"wrong": "wrong result", "uninit": "uninitialised output", "fork": "unsafe",
                        "oob": "out-of-bounds access", "good": "ok"}
    assert "past the end of b" in next(t.reason for t in tried if t.verdict == "out-of-bounds access")
