"""Kernel selection: real candidates compiled, checked and timed in subprocesses; a wrong and
a crashing external kernel are rejected with their reason and the build uses the next best;
op groups carry the epilogue the CPU library absorbs, and every candidate is checked with it."""

from __future__ import annotations

import collections
import dataclasses
import json
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
import tvm
from tvm import relax, runtime

import gimlet_tvm
from gimlet_tvm.compiler import resolve_target
from gimlet_tvm.errors import GimletError
from gimlet_tvm.frontend import import_model
from gimlet_tvm.relax_passes.dispatch_cpu_library import (CONV_ALGORITHMS, ConvAlgorithm,
                                                        default_conv_algorithm, direct_conv_block)
from gimlet_tvm.runtime.cuda_runtime import load_cuda_library
from gimlet_tvm.schedules.kernel_selection.apply import rewrite_ops
from gimlet_tvm.schedules.kernel_selection.candidates import OpSignature
from gimlet_tvm.schedules.kernel_selection.choices import SELECTION_FILE, KernelSelection, OpChoice, Tried
from gimlet_tvm.schedules.kernel_selection.sources import candidates, find, signature_conv_shape
from gimlet_tvm.selection.select import op_signatures, select_kernels
from gimlet_tvm.selection.verify import Verifier, run_candidate
from gimlet_tvm.targets.cpu import CPU_KERNELS
from gimlet_tvm.schedules.tuning.records import target_key

from .conftest import suite_model

M, K, N = 5, 24, 40
SIG = OpSignature("matmul", ((M, K), (K, N)), "float32")
WEIGHT_SIG = dataclasses.replace(SIG, weight=True)  # B a constant, as in a model

# A correct external kernel, one that is off (adds 1 to every output) and one that writes
# 2 TiB past its output (a real SIGSEGV in the verifying subprocess).
KERNEL = """
# from tvm.script import tirx as T

@T.prim_func
def gemm(a: T.Buffer(({m}, {k}), "float32"), b: T.Buffer(({k}, {n}), "float32"),
         c: T.Buffer(({m}, {n}), "float32")):
    T.func_attr({{"tir.noalias": True, "tirx.is_scheduled": True}})
    for i, j in T.grid({m}, {n}):
        c[i, j] = T.float32({offset})
        for kk in range({k}):
            c[i, j] = c[i, j] + a[i, kk] * b[kk, j]
    {crash}
"""
CRASH = """flat = T.decl_buffer((T.int64(1) << T.int64(42),), "float32", data=c.data)
    flat[T.int64(1) << T.int64(41)] = T.float32(1)"""
EXTERNAL = {"good": ("0", ""), "wrong": ("1", ""), "crash": ("0", CRASH)}


def _matmul_model() -> onnx.ModelProto:
    weight = np.random.default_rng(1).standard_normal((K, N)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "one_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", N])],
        [onnx.numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def write_external_kernels(directory):
    """The good, the wrong and the crashing kernel in `directory`, with their manifest."""
    entries = []
    for name, (offset, crash) in EXTERNAL.items():
        (directory / f"{name}.py").write_text(KERNEL.format(m=M, k=K, n=N, offset=offset, crash=crash))
        entries.append({"name": name, "op": "matmul", "dtype": "float32", "shapes": [[M, K], [K, N]],
                        "target": "llvm", "format": "tvmscript", "source": f"{name}.py"})
    (directory / "kernels.json").write_text(json.dumps({"kernels": entries}))
    return directory


@pytest.fixture
def kernels(tmp_path):
    """An external kernel directory with the good, the wrong and the crashing kernel."""
    return write_external_kernels(tmp_path)


def _request(candidate_id: str, target, external_dir=None) -> dict:
    return {"signature": SIG.to_json(), "candidate": candidate_id, "target": json.loads(str(target)),
            "external_dir": external_dir, "records": None, "min_repeat_ms": 1}


def test_candidates_from_every_source(kernels):
    _, target = resolve_target("llvm")
    ids = [c.id for c in candidates(SIG, target, str(kernels))]
    assert ids == ["generated:tir", "library:openblas", "handwritten:cpu_gemm_6x2v",
                   "handwritten:cpu_gemm_packed_4x2v", "handwritten:cpu_gemm_packed_tallx2v",
                   "handwritten:cpu_gemv_k4", "external:good", "external:wrong", "external:crash"]
    other_shape = OpSignature("matmul", ((M + 1, K), (K, N)), "float32")
    assert not [c for c in candidates(other_shape, target, str(kernels)) if c.source == "external"]


def _two_matmuls_rewritten(choose, seed: int) -> tvm.IRModule:
    """x @ w1 @ w2 (two matmul groups of different shapes) with both groups rewritten by
    `choose`: checks that it builds and computes right, and returns the rewritten module."""
    rng = np.random.default_rng(seed)
    w1, w2 = rng.standard_normal((K, N)).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((M, K), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(relax.op.matmul(x, relax.const(w1)))
            y = bb.emit_output(relax.op.matmul(h, relax.const(w2)))
        bb.emit_func_output(y)
    mod, rewritten = rewrite_ops(bb.finalize(), choose, resolve_target("llvm")[1])
    assert rewritten == 2
    executable = gimlet_tvm.compiler.compile_alone(mod, resolve_target("llvm"))
    data = rng.standard_normal((M, K)).astype(np.float32)
    got = relax.VirtualMachine(executable, runtime.cpu())["main"](runtime.tensor(data))
    np.testing.assert_allclose(got.numpy(), data @ w1 @ w2, rtol=1e-4, atol=1e-4)
    return mod


def test_one_kernel_at_several_shapes_in_one_model():
    """Two matmul groups of different shapes, both rewritten into the same hand-written kernel
    (two PrimFuncs from one TVMScript function), build and compute right."""
    _, target = resolve_target("llvm")
    _two_matmuls_rewritten(lambda sig: find("handwritten:cpu_gemm_packed_4x2v", sig, target), seed=5)


def test_handwritten_kernel_made_once_per_shape_and_epilogue():
    """A shape a model repeats reuses its PrimFunc (parsing the TVMScript again took 0.5 s a
    group: 30 s for one cold timing's 64 copies of a group)."""
    _, target = resolve_target("llvm")
    kernel = next(k for k in CPU_KERNELS if k.name == "cpu_gemm_packed_4x2v")
    relu = (("relu", ()),)
    made = kernel.prim_func(target, M, N, K, relu, [])
    assert kernel.prim_func(target, M, N, K, relu, []) is made
    assert kernel.prim_func(target, M, N, K, (), []) is not made
    assert kernel.prim_func(target, M + 1, N, K, relu, []) is not made


def test_handwritten_cpu_gemm_verified_at_edge_case_shape():
    _, target = resolve_target("llvm")
    outcome = run_candidate(_request("handwritten:cpu_gemm_6x2v", target), timeout=120)
    assert outcome.verified, outcome.reason
    assert outcome.checks == [SIG.key, SIG.edge_case().key] and outcome.seconds > 0


@pytest.mark.parametrize("mr, packed, m, n, k", [
    (14, True, 32, 100, 600),  # tiles 11, 11, 10 (accumulators in two arrays); K blocks 256, 256, 88; N tail
    (14, False, 15, 33, 513),  # tiles 8, 7; K blocks with a 1-deep tail; a 1-column tail panel
    (4, True, 1, 64, 256),  # one row, one K block
])
def test_cpu_gemm_tiles_blocks_and_tails(mr, packed, m, n, k):
    """`cpu_gemm` against numpy where its row tiles, K blocks and column tails all come into
    play, with a bias + ReLU epilogue, at AVX-512's panel width (32) whatever this CPU is."""
    import tvm

    from gimlet_tvm.targets.kernels.cpu_gemm import cpu_gemm, packed_shape

    nr = 32
    func = cpu_gemm(mr, nr, packed, m, n, k, (("add", (n,)), ("relu", ())), [(1, n)])
    built = tvm.compile(tvm.IRModule({"main": func}), resolve_target("llvm")[1])
    rng = np.random.default_rng(7)
    a, b, bias = (rng.standard_normal(shape).astype(np.float32) for shape in ((m, k), (k, n), (1, n)))
    b_arg = b
    if packed:
        panels = packed_shape(n, k, nr)
        padded = np.zeros((k, panels[0] * nr), np.float32)
        padded[:, :n] = b
        b_arg = np.ascontiguousarray(padded.reshape(k, panels[0], nr).transpose(1, 0, 2))
    c = runtime.tensor(np.full((m, n), np.nan, np.float32))
    built["main"](*(runtime.tensor(x) for x in (a, b_arg, bias)), c)
    np.testing.assert_allclose(c.numpy(), np.maximum(a @ b + bias, 0), rtol=1e-4, atol=1e-4)


def test_packed_gemm_only_for_weights_and_packs_at_build_time():
    """The packed GEMM takes B in panels: offered only where B is a constant, whose packing
    is then a constant of the build (no packing left in the model's code); verified with B
    packed at run time and timed with packed constant copies of B."""
    _, target = resolve_target("llvm")
    assert "constant weight" in find("handwritten:cpu_gemm_packed_tallx2v", SIG, target).unavailable
    packed = find("handwritten:cpu_gemm_packed_tallx2v", WEIGHT_SIG, target)
    assert packed.unavailable is None
    weight = np.random.default_rng(3).standard_normal((K, N)).astype(np.float32)
    mod, rewritten = rewrite_ops(WEIGHT_SIG.module([weight]), lambda sig: packed, resolve_target("llvm")[1])
    assert rewritten == 1
    assert "R.permute_dims" not in mod.script()  # packed into a constant as the group was rewritten
    executable = gimlet_tvm.compiler.compile_alone(mod, resolve_target("llvm"))
    assert "permute_dims" not in executable.as_text()  # folded into a packed constant
    x = np.random.default_rng(4).standard_normal((M, K)).astype(np.float32)
    (got,) = relax.VirtualMachine(executable, runtime.cpu())["main"](runtime.tensor(x))
    np.testing.assert_allclose(got.numpy(), x @ weight, rtol=1e-5, atol=1e-5)
    request = dict(_request("handwritten:cpu_gemm_packed_tallx2v", target), signature=WEIGHT_SIG.to_json())
    outcome = run_candidate(request, timeout=120)
    assert outcome.verified, outcome.reason
    assert outcome.checks == [WEIGHT_SIG.key, WEIGHT_SIG.edge_case().key] and outcome.seconds > 0


@pytest.mark.parametrize("candidate_id", ["handwritten:cuda_gemm_16x16", "library:cublas"])
def test_cuda_candidates_build(candidate_id):
    """The hand-written CUDA GEMM (compiled by nvcc) and cuBLAS's SGEMM (our extension, built
    against cuBLAS's headers and linked to it: the test setup installs it) build into a CUDA
    executable in the verifying child; with a GPU they are also checked against the reference."""
    spec, target = resolve_target("cuda")
    if spec.can_compile() is not None:
        pytest.skip(spec.can_compile())
    assert find(candidate_id, SIG, target).unavailable is None
    outcome = run_candidate(_request(candidate_id, target), timeout=120)
    if spec.can_run() is None:
        assert outcome.verified, outcome.reason
    else:  # built in the child; only the run is missing
        assert not outcome.verified and outcome.reason.startswith("compiled; cannot run"), outcome.reason


def test_cuda_build_calls_cublas_where_selected():
    """A selection whose winners are cuBLAS builds the MLP for CUDA with every matmul a call of
    `gimlet.cuda.matmul` (the GPU kernels compiled by nvcc around them)."""
    spec, target = resolve_target("cuda")
    if spec.can_compile() is not None:
        pytest.skip(spec.can_compile())
    proto = suite_model("mlp")
    shapes = {"x": [3, 1024]}
    mod, _ = import_model(proto, shapes)
    choices = {}
    for sig in op_signatures(mod, target):
        cublas = find("library:cublas", sig, target)
        assert cublas.unavailable is None, cublas.unavailable
        choices[sig.key] = OpChoice(sig, [Tried(cublas.id, cublas.provenance, True, seconds=1.0)], cublas.id)
    assert len(choices) == 3
    model = gimlet_tvm.build(proto, "cuda", input_shapes=shapes, selection=KernelSelection(target_key(target), choices))
    lines = model._module.as_text().splitlines()  # pylint: disable=protected-access
    calls = [line for line in lines if re.match(r"\s*call\s", line) and "matmul" in line]
    assert len(calls) == 3 and all("gimlet.cuda.matmul" in line for line in calls), calls


def test_cublas_matmul_names_what_is_wrong_with_its_arguments():
    """`gimlet.cuda.matmul` is registered once the extension loads, and refuses tensors it
    cannot take (here: on the CPU) with the reason, before any cuBLAS call."""
    assert load_cuda_library() is None
    matmul = tvm.get_global_func("gimlet.cuda.matmul")
    a = tvm.runtime.tensor(np.ones((2, 3), "float32"))
    with pytest.raises(Exception, match="a must be on CUDA device 0"):
        matmul(a, a, a)
    with pytest.raises(Exception, match="must be float32"):
        matmul(tvm.runtime.tensor(np.ones((2, 3), "float64")), a, a)


def _select_on_matmul_model(cli, tmp_path, kernels):
    """`gimlet-tvm select` on the one-matmul model at [M, K] with the external kernels in
    `kernels`: its stdout, stderr, the model's path and the records directory."""
    model_path = tmp_path / "matmul.onnx"
    onnx.save(_matmul_model(), model_path)
    records = tmp_path / "records"
    code, out, err = cli("select", str(model_path), "--records", str(records), "--kernels", str(kernels),
                         "--input-shape", f"x={M},{K}")
    assert code == 0, err
    return out, err, model_path, records


@pytest.mark.slow  # ~100 s; CI runs the same rejections over RPC (test_rpc.test_select_on_a_remote_server)
def test_select_rejects_wrong_and_crashing_kernels_and_builds(cli, kernels, tmp_path):
    from gimlet_tvm.selection import select

    out, err, model_path, records = _select_on_matmul_model(cli, tmp_path, kernels)
    assert re.search(r"external:wrong +no: wrong result at matmul float32 5x24 @ const 24x40 on random", out), out
    assert re.search(r"external:crash +no: crashed \(SIGSEGV\)", out), out
    assert f"{WEIGHT_SIG.key}: external:crash no: crashed (SIGSEGV)" in err  # progress, as it goes
    assert "model builds with the selection" in out
    stored = json.loads((records / SELECTION_FILE).read_text())
    (choice,) = next(iter(stored["targets"].values()))["ops"].values()
    tried = {t["id"]: t for t in choice["tried"]}
    assert not tried["external:wrong"]["verified"] and not tried["external:crash"]["verified"]
    assert all(tried[i]["verified"] for i in ("generated:tir", "library:openblas", "handwritten:cpu_gemm_6x2v",
                                              "handwritten:cpu_gemm_packed_tallx2v", "external:good"))
    assert choice["winner"] not in ("external:wrong", "external:crash")
    verified = [select.Tried(**t) for t in tried.values() if t["verified"]]
    assert choice["winner"] == select._winner(verified)

    # The build applies the stored winner, and every restriction to one source runs right.
    _, target = resolve_target("llvm")
    selection = KernelSelection.load(records, target)
    x = np.random.default_rng(2).standard_normal((M, K)).astype(np.float32)
    weight = onnx.numpy_helper.to_array(_matmul_model().graph.initializer[0])
    for chosen in [None, *(selection.restricted_to(s) for s in ("generated", "handwritten", "external"))]:
        model = gimlet_tvm.build(model_path, "llvm", input_shapes={"x": [M, K]}, records=records,
                                 selection=chosen)
        np.testing.assert_allclose(model(x)[0], x @ weight, rtol=1e-4, atol=1e-4)

    # An external winner whose source changed since it was verified is refused.
    external = selection.restricted_to("external")
    assert next(iter(external.choices.values())).winner == "external:good"
    (kernels / "good.py").write_text((kernels / "good.py").read_text() + "\n")
    with pytest.raises(GimletError, match="changed since it was verified"):
        gimlet_tvm.build(model_path, "llvm", input_shapes={"x": [M, K]}, selection=external)


# `dot` is global on purpose: two kernels linked into one model both define it.
C_KERNEL = """
#include <stddef.h>

float dot(const float *row, const float *column, int k, int stride) {{
  float sum = 0.0f;
  for (int i = 0; i < k; ++i) sum += row[i] * column[i * stride];
  return sum;
}}

void gemm(const float *a, const float *b, float *c) {{
  for (int i = 0; i < {m}; ++i)
    for (int j = 0; j < {n}; ++j) c[i * {n} + j] = {offset} + dot(a + i * {k}, b + j, {k}, {n});
  {crash}
}}
"""
C_EXTERNAL = {"c_good": ("0.0f", ""), "c_wrong": ("1.0f", ""),
              "c_crash": ("0.0f", "c[(size_t)1 << 41] = 1.0f;"), "c_broken": ("0.0f", "return 1 +;")}


@pytest.mark.slow  # ~110 s in CI: CI ran 60 minutes; C kernels are built and linked by the generator tests too
def test_external_c_kernels_are_checked_linked_and_exported(cli, tmp_path):
    """External kernels given as C source: the good one is verified and, chosen, compiled into
    the model (and into its exported artifact); the wrong, crashing and non-compiling ones are
    rejected with the reason."""
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    entries = []
    for name, (offset, crash) in C_EXTERNAL.items():
        (kernels / f"{name}.c").write_text(C_KERNEL.format(m=M, k=K, n=N, offset=offset, crash=crash))
        entries.append({"name": name, "function": "gemm", "op": "matmul", "dtype": "float32",
                        "shapes": [[M, K], [K, N]], "target": "llvm", "format": "c", "source": f"{name}.c"})
    (kernels / "kernels.json").write_text(json.dumps({"kernels": entries}))
    out, err, model_path, records = _select_on_matmul_model(cli, tmp_path, kernels)
    assert re.search(r"external:c_wrong +no: wrong result at matmul float32 5x24 @ const 24x40", out), out
    assert re.search(r"external:c_crash +no: crashed \(SIGSEGV\)", out), out
    assert re.search(r"external:c_broken +no: compile failed at .*c_broken\.c.*error", out), out
    assert re.search(r"external:c_good +yes +[0-9.]+", out), out

    _, target = resolve_target("llvm")
    external = KernelSelection.load(records, target).restricted_to("external")
    assert next(iter(external.choices.values())).winner == "external:c_good"
    model = gimlet_tvm.build(model_path, "llvm", input_shapes={"x": [M, K]}, selection=external)
    x = np.random.default_rng(3).standard_normal((M, K)).astype(np.float32)
    want = x @ onnx.numpy_helper.to_array(_matmul_model().graph.initializer[0])
    np.testing.assert_allclose(model(x)[0], want, rtol=1e-4, atol=1e-4)
    artifact = tmp_path / "model.so"
    model.export(artifact)
    np.testing.assert_allclose(gimlet_tvm.load(artifact)(x)[0], want, rtol=1e-4, atol=1e-4)


def test_two_c_kernels_with_the_same_helper_link_into_one_model(tmp_path):
    """Two matmul groups, each rewritten into its own external C kernel; both sources define a
    global `dot`, which stays private to each kernel, so the model links and computes right."""
    _, target = resolve_target("llvm")
    entries = []
    for name, (m, k, n) in {"first": (M, K, N), "second": (M, N, K)}.items():
        (tmp_path / f"{name}.c").write_text(C_KERNEL.format(m=m, k=k, n=n, offset="0.0f", crash=""))
        entries.append({"name": name, "function": "gemm", "op": "matmul", "dtype": "float32",
                        "shapes": [[m, k], [k, n]], "target": "llvm", "format": "c", "source": f"{name}.c"})
    (tmp_path / "kernels.json").write_text(json.dumps({"kernels": entries}))
    external = lambda sig: next(c for c in candidates(sig, target, str(tmp_path)) if c.source == "external")
    mod = _two_matmuls_rewritten(external, seed=6)
    assert len(mod.attrs["external_mods"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_op_groups_only_take_activations_their_candidates_implement(activation):
    """A matmul whose library epilogue has a SiLU (which no candidate, reference or kernel
    generator implements) is no op group: it keeps the library call; with a ReLU it is one."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"])]
    if activation == "relu":
        nodes.append(helper.make_node("Relu", ["m"], ["y"]))
    else:
        nodes += [helper.make_node("Sigmoid", ["m"], ["s"]), helper.make_node("Mul", ["m", "s"], ["y"])]
    weight = np.random.default_rng(1).standard_normal((K, N)).astype(np.float32)
    graph = helper.make_graph(nodes, "matmul_activation",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])],
                              [onnx.numpy_helper.from_array(weight, "w")])
    _, target = resolve_target("llvm")
    mod, _ = import_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), None)
    signatures = op_signatures(mod, target)
    assert [sig.epilogue for sig in signatures] == ([(("relu", ()),)] if activation == "relu" else [])


def test_selection_on_an_architecture_from_outside_the_suite():
    """ShuffleNet as onnx ships it (its bundled "light" model: grouped 1x1 convs, depthwise
    convs, channel shuffles, a Gemm classifier; weights are constant fills, so each group's own
    check on random inputs is what tests the kernels): every op group gets a verified winner,
    and the model built from the selection runs and matches onnxruntime. Of its 18 op groups,
    the 6 depthwise convs run in the blocked layout (on by default for networks with depthwise
    convs; the 136-channel ones padded to 144), on its own kernels: selection, which sees the
    model after that pass, has the 12 others. Where the channel block is 8 (AVX2), the blocked
    layout takes three more of the groups: selection has 9."""
    from pathlib import Path

    from gimlet_tvm.peers import check_against_onnxruntime

    proto = onnx.load(Path(onnx.__file__).parent / "backend/test/data/light/light_shufflenet.onnx")
    inputs = {"gpu_0/data_0": np.random.default_rng(7).standard_normal((1, 3, 224, 224)).astype(np.float32)}
    shapes = {name: list(x.shape) for name, x in inputs.items()}
    _, target = resolve_target("llvm")
    mod, _ = import_model(proto, shapes)
    selection = select_kernels(mod, target, timeout=300, min_repeat_ms=1)
    groups = 9 if direct_conv_block() == 8 else 12
    assert len(selection.choices) >= groups and all(c.winner for c in selection.choices.values())
    assert not [c for c in selection.choices.values() if c.signature.op == "conv2d" and c.signature.shapes[1][1] == 1]
    model = gimlet_tvm.build(proto, "llvm", input_shapes=shapes, selection=selection)
    ok, diff = check_against_onnxruntime(proto, model, inputs, tolerance=1e-4)
    assert ok, diff


def test_select_on_symbolic_shapes_says_how_to_fix_them(cli, tmp_path):
    """A model whose batch is symbolic has no static-shape op group: select says which input
    is symbolic and how to fix it, and the model still builds."""
    model_path = tmp_path / "matmul.onnx"
    onnx.save(_matmul_model(), model_path)
    code, out, err = cli("select", str(model_path), "--records", str(tmp_path / "records"))
    assert code == 0, err
    assert f"inputs with symbolic dims: x [batch, {K}]: fix them with --input-shape" in out, out
    assert "selected in" in out and "nothing" in out and "model builds with the selection" in out


def test_selection_rewrites_only_into_the_chosen_kernel():
    _, target = resolve_target("llvm")
    handwritten = find("handwritten:cpu_gemm_6x2v", SIG, target)
    text = rewrite_ops(SIG.module(), lambda sig: handwritten, resolve_target("llvm")[1])[0].script()
    assert "cpu_gemm_6x2v" in text and "R.matmul" not in text
    untouched = rewrite_ops(SIG.module(), lambda sig: None, resolve_target("llvm")[1])[0].script()
    assert "gimlet.cpu.matmul" in untouched  # the op group as the library pass formed it


# A linear layer + ReLU, and one with GELU and a residual add (a transformer's FFN shape).
BIAS_RELU = OpSignature("matmul", ((M, K), (K, N)), "float32", (("add", (N,)), ("relu", ())), weight=True)
GELU_RESIDUAL = OpSignature("matmul", ((1, M, K), (K, N)), "float32",
                            (("add", (N,)), ("gelu", ()), ("add", (1, M, N))), weight=True)

# An external kernel of the bias + ReLU group; `{bias}` is the bias term (left out: wrong).
EPILOGUE_KERNEL = """
# from tvm.script import tirx as T

@T.prim_func
def gemm(a: T.Buffer(({m}, {k}), "float32"), b: T.Buffer(({k}, {n}), "float32"),
         bias: T.Buffer((1, {n}), "float32"), c: T.Buffer(({m}, {n}), "float32")):
    T.func_attr({{"tir.noalias": True, "tirx.is_scheduled": True}})
    for i, j in T.grid({m}, {n}):
        c[i, j] = T.float32(0)
        for kk in range({k}):
            c[i, j] = c[i, j] + a[i, kk] * b[kk, j]
        c[i, j] = T.max(c[i, j]{bias}, T.float32(0))
"""


def test_op_group_is_what_the_library_absorbs():
    """MatMul + Add + Relu is one signature with its epilogue, read from DispatchCPULibrary."""
    weight = np.ones((K, N), np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["hb"]),
         helper.make_node("Relu", ["hb"], ["y"])], "linear_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])],
        [onnx.numpy_helper.from_array(weight, "w"), onnx.numpy_helper.from_array(weight[0], "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    _, target = resolve_target("llvm")
    mod, _ = import_model(model, {"x": [M, K]})
    assert op_signatures(mod, target) == {BIAS_RELU: 1}
    assert BIAS_RELU.key == f"matmul float32 {M}x{K} @ const {K}x{N} +{N} relu"
    assert OpSignature.from_json(json.loads(json.dumps(BIAS_RELU.to_json()))) == BIAS_RELU


@pytest.mark.parametrize("candidate_id", ["generated:tir", "library:openblas", "handwritten:cpu_gemm_6x2v",
                                          "handwritten:cpu_gemm_packed_4x2v", "handwritten:cpu_gemm_packed_tallx2v",
                                          "handwritten:cpu_gemv_k4"])
def test_every_source_fuses_the_epilogue(candidate_id):
    """Each source computes matmul + bias + GELU + residual, checked against the reference
    group at its shapes and the edge-case ones."""
    _, target = resolve_target("llvm")
    request = dict(_request(candidate_id, target), signature=GELU_RESIDUAL.to_json())
    outcome = run_candidate(request, timeout=180)
    assert outcome.verified, outcome.reason
    assert outcome.checks == [GELU_RESIDUAL.key, GELU_RESIDUAL.edge_case().key]
    assert GELU_RESIDUAL.edge_case().epilogue == (("add", (69,)), ("gelu", ()), ("add", (1, 11, 69)))
    if candidate_id.startswith("handwritten"):
        text = rewrite_ops(GELU_RESIDUAL.module(), lambda sig: find(candidate_id, sig, target), resolve_target("llvm")[1])[0].script()
        assert "gimlet.cpu.matmul" not in text and "R.nn.gelu" not in text and "R.add" not in text


def test_wrong_epilogue_rejected(tmp_path):
    """A kernel of the bias + ReLU group that leaves out the bias is not verified."""
    entries = []
    for name, bias in (("fused", " + bias[0, j]"), ("no_bias", "")):
        (tmp_path / f"{name}.py").write_text(EPILOGUE_KERNEL.format(m=M, k=K, n=N, bias=bias))
        entries.append({"name": name, "op": "matmul", "dtype": "float32", "shapes": [[M, K], [K, N]],
                        "epilogue": [["add", [N]], ["relu", []]], "target": "llvm",
                        "format": "tvmscript", "source": f"{name}.py"})
    (tmp_path / "kernels.json").write_text(json.dumps({"kernels": entries}))
    _, target = resolve_target("llvm")
    assert [c.id for c in candidates(SIG, target, str(tmp_path)) if c.source == "external"] == []
    outcomes = {}
    for name in ("fused", "no_bias"):
        request = dict(_request(f"external:{name}", target, str(tmp_path)), signature=BIAS_RELU.to_json())
        outcomes[name] = run_candidate(request, timeout=120)
    assert outcomes["fused"].verified, outcomes["fused"].reason
    assert not outcomes["no_bias"].verified
    assert outcomes["no_bias"].reason.startswith(f"wrong result at {BIAS_RELU.key} on random"), outcomes["no_bias"].reason


def test_close_candidates_raced_together_and_median_decides(monkeypatch):
    """Candidates within the margin of the fastest are timed again together; the median of
    their rounds is their time. A failed race leaves the first timings (and says why)."""
    from gimlet_tvm.selection import select
    from gimlet_tvm.selection.verify import Race

    rounds = {"a": [3.0, 2.0, 3.0], "b": [1.1, 1.3, 1.2]}  # the first measurement of "a" was lucky
    raced = []

    def fake_race(request, timeout):
        raced.append(request["candidates"])
        return Race({cid: rounds[cid] for cid in request["candidates"]})

    monkeypatch.setattr(select, "race_candidates", fake_race)
    tried = [select.Tried("a", "", True, seconds=1.0), select.Tried("b", "", True, seconds=2.9),
             select.Tried("c", "", True, seconds=3.1), select.Tried("d", "", False, "wrong")]
    assert select._race_close(tried, {"signature": SIG.to_json()}, timeout=1) is None
    assert raced == [["a", "b"]]
    assert [t.seconds for t in tried[:3]] == [3.0, 1.2, 3.1] and tried[1].rounds == rounds["b"]

    monkeypatch.setattr(select, "race_candidates", lambda request, timeout: Race({}, "crashed (SIGSEGV)"))
    tried = [select.Tried("a", "", True, seconds=1.0), select.Tried("b", "", True, seconds=1.2)]
    assert select._race_close(tried, {"signature": SIG.to_json()}, timeout=1) == "crashed (SIGSEGV)"
    assert [t.seconds for t in tried] == [1.0, 1.2] and not tried[0].rounds


def test_race_ties_go_to_the_preferred_source():
    """The fastest wins unless the race cannot tell it from another: then the first source of
    SOURCE_PREFERENCE (generated code before hand-written kernels before library calls)."""
    from gimlet_tvm.selection import select

    def tried(cid: str, rounds: list[float]):
        return select.Tried(cid, "", True, seconds=sorted(rounds)[len(rounds) // 2], rounds=rounds)

    noise = [1.0, 1.08, 0.95, 1.02, 0.97, 1.06, 0.93, 1.01, 1.04]
    base = [2.0] * 9
    handwritten = tried("handwritten:k", base)
    equal = tried("generated:tir", [b * x for b, x in zip(base, noise)])  # median 1.01x, spread both ways
    slower = tried("generated:tir", [b * 1.03 * x / min(noise) for b, x in zip(base, noise)])  # every round slower
    library = tried("library:blas", [b * 0.98 * x for b, x in zip(base, noise)])  # fastest median, within noise
    assert select._winner([handwritten, equal]) == "generated:tir"
    assert select._winner([handwritten, slower]) == "handwritten:k"
    assert select._winner([library, handwritten]) == "handwritten:k"
    assert select._winner([select.Tried("library:blas", "", True, seconds=1.0),
                           select.Tried("generated:tir", "", True, seconds=1.01)]) == "library:blas"  # not raced
    assert select._winner([select.Tried("generated:tir", "", False, "wrong")]) is None


def test_race_times_every_candidate_in_every_round(kernels):
    """The race child builds each candidate once and times all of them in each round; one
    that crashes when run fails the race with the signal named, not the caller."""
    from gimlet_tvm.selection.verify import race_candidates

    _, target = resolve_target("llvm")
    request = dict(_request("", target, str(kernels)), rounds=3)
    ids = ["library:openblas", "handwritten:cpu_gemm_6x2v", "external:good"]
    race = race_candidates(dict(request, candidates=ids), timeout=300)
    assert race.failure == "" and sorted(race.samples) == sorted(ids)
    assert all(len(times) == 3 and all(0 < t < 0.1 for t in times) for times in race.samples.values())
    race = race_candidates(dict(request, candidates=["external:good", "external:crash"]), timeout=300)
    assert race.failure.startswith("crashed (SIGSEGV)") and race.samples == {}


def test_one_child_serves_a_group_and_a_crash_loses_none_after_it(kernels):
    """A `Verifier` verifies an op group's candidates one after another; a candidate that runs
    past its time (here the child is still importing TVM) or crashes the child (SIGSEGV) gets
    the verdict a child of its own would give, and the candidates after it are verified by a
    fresh child."""
    _, target = resolve_target("llvm")
    request = _request("", target, str(kernels))
    with Verifier() as verifier:
        late, good, crash, wrong, again = (
            verifier.run(dict(request, candidate=f"external:{name}"), timeout)
            for name, timeout in (("good", 0.5), ("good", 120), ("crash", 120), ("wrong", 120), ("good", 120)))
    assert late.verdict == "timeout" and late.reason == "timed out after 0.5 s (compile, run or check)", late
    assert good.verified and again.verified and good.seconds > 0 and again.seconds > 0
    assert crash.verdict == "crash" and crash.reason.startswith("crashed (SIGSEGV)"), crash
    assert wrong.verdict == "wrong result" and "on random inputs" in wrong.reason, wrong


def encoder_group(op: str):
    """The suite's transformer encoder at batch 1 (model, inputs, input shapes, imported
    module) and its one op signature of `op` on llvm."""
    from gimlet_tvm.models import SUITE

    info = SUITE["transformer_encoder"]
    proto, inputs = info.build(), info.example_inputs(batch=1)
    shapes = {name: list(x.shape) for name, x in inputs.items()}
    mod, _ = import_model(proto, shapes)
    (sig,) = [sig for sig in op_signatures(mod, resolve_target("llvm")[1]) if sig.op == op]
    return proto, inputs, shapes, mod, sig


def encoder_attention():
    """`encoder_group` of the encoder's attention (with its padding-mask bias)."""
    return encoder_group("attention")


def test_attention_is_an_op_group_with_library_and_generated_candidates():
    """The encoder's attention (with its padding-mask bias) is an op signature of its own:
    the CPU library's attention and the generated TIR are both verified against the float64
    reference (at its shape and the edge-case one), and a build that takes the generated
    one computes the model as onnxruntime does."""
    from gimlet_tvm.peers import check_against_onnxruntime

    proto, inputs, shapes, mod, attention = encoder_attention()
    _, target = resolve_target("llvm")
    assert attention.key == "attention float32 1x64x4x64 1x64x4x64 1x64x4x64 1x1x1x64 scale=0.125"
    assert OpSignature.from_json(json.loads(json.dumps(attention.to_json()))) == attention
    assert [c.id for c in candidates(attention, target)] == ["generated:tir", "library:gimlet_attention"]
    for candidate_id in ("generated:tir", "library:gimlet_attention"):
        request = dict(_request(candidate_id, target), signature=attention.to_json())
        outcome = run_candidate(request, timeout=180)
        assert outcome.verified, outcome.reason
        assert outcome.checks == [attention.key, attention.edge_case().key]

    generated = find("generated:tir", attention, target)
    text = rewrite_ops(mod, lambda sig: generated if sig == attention else None, resolve_target("llvm")[1])[0].script()
    assert "gimlet.cpu.attention" not in text and "gimlet.cpu.matmul" in text
    choice = OpChoice(attention, [Tried("generated:tir", generated.provenance, True, seconds=1.0)], "generated:tir")
    selection = KernelSelection(target_key(target), {attention.key: choice})
    model = gimlet_tvm.build(proto, "llvm", input_shapes=shapes, selection=selection)
    ok, diff = check_against_onnxruntime(proto, model, inputs, tolerance=1e-4)
    assert ok, diff


def test_selection_of_a_kernel_no_longer_offered_is_refused():
    """A stored winner that the repo has since dropped (here a hand-written kernel's old name)
    stops the build with a message naming it, not a KeyError."""
    _, target = resolve_target("llvm")
    gone = "handwritten:cpu_gemm_packed_6x2v"
    choice = OpChoice(WEIGHT_SIG, [Tried(gone, "cpu_gemm.py", True, seconds=1.0)], gone)
    selection = KernelSelection(target_key(target), {WEIGHT_SIG.key: choice})
    with pytest.raises(GimletError, match=f"kernel {gone}, selected for .* no longer offered"):
        selection.winner(WEIGHT_SIG, target)

def test_layer_norms_are_an_op_group_with_a_generated_candidate():
    """The encoder's two LayerNorms (the ONNX op and the written-out chain, fused) are one op
    signature, epsilon an attribute; its generated TIR, the only candidate the compiler has, is
    verified against the float64 reference (at its shape and the edge-case one, on the norm's
    own input sets too)."""
    _, _, _, mod, norm = encoder_group("layer_norm")
    _, target = resolve_target("llvm")
    assert op_signatures(mod, target)[norm] == 2
    assert norm.key == "layer_norm float32 1x64x256 256 256 epsilon=1e-05" and norm.weight
    assert norm.edge_case().key == "layer_norm float32 1x7x37 37 37 epsilon=1e-05"
    assert OpSignature.from_json(json.loads(json.dumps(norm.to_json()))) == norm
    assert list(norm.input_sets(np.random.default_rng(0))) == [
        "random", "integers", "large", "zeros", "small-variance", "offset-rows"]
    assert [c.id for c in candidates(norm, target)] == ["generated:tir"]
    outcome = run_candidate(dict(_request("generated:tir", target), signature=norm.to_json()), timeout=180)
    assert outcome.verified, outcome.reason
    assert outcome.checks == [norm.key, norm.edge_case().key]


def _written_out_norm(x: np.ndarray, gamma: np.ndarray, beta, epsilon: float, centered: bool) -> np.ndarray:
    """A norm over gamma's trailing axes, row by row in plain Python."""
    size = gamma.size
    rows = x.reshape(-1, size)
    out = np.empty_like(rows)
    for r, row in enumerate(rows):
        mean = sum(row) / size if centered else 0.0
        variance = sum((v - mean) ** 2 for v in row) / size
        for i in range(size):
            shift = beta.flat[i] if centered else 0.0
            out[r, i] = (row[i] - mean) / np.sqrt(variance + epsilon) * gamma.flat[i] + shift
    return out.reshape(x.shape)


def test_norm_references_shapes_and_kernel_arrays():
    """The layer and RMS norm references (what candidates are checked against) against a norm
    written out, over one and two trailing axes; their edge cases and the arrays an outside
    kernel takes (rows and normalized axes folded); only trailing axes in order, with an
    epsilon, are a group."""
    from gimlet_tvm.schedules.kernel_selection.op_kinds import OP_KINDS

    rng = np.random.default_rng(8)
    for op, shapes in (("layer_norm", ((2, 3, 5), (5,), (5,))), ("layer_norm", ((2, 3, 5), (3, 5), (3, 5))),
                       ("rms_norm", ((4, 6), (6,))), ("rms_norm", ((2, 3, 5), (3, 5)))):
        sig = OpSignature(op, shapes, "float32", attrs=(("epsilon", 0.01),))
        operands = [rng.standard_normal(shape) for shape in shapes]
        want = _written_out_norm(*operands[:2], operands[2] if op == "layer_norm" else None, 0.01,
                                 centered=op == "layer_norm")
        np.testing.assert_allclose(sig.reference(*operands), want, rtol=1e-12)
        assert sig.kind.valid(sig.shapes) and sig.out_shape == shapes[0]
        rows, size = np.prod(shapes[0]) // np.prod(shapes[1]), np.prod(shapes[1])
        affine = [(name, (size,)) for name in ("gamma", "beta")[:len(shapes) - 1]]
        assert sig.kernel_operands() == [("x", (rows, size)), *affine, ("out", (rows, size))]
    two_axes = OpSignature("layer_norm", ((2, 3, 5), (3, 5), (3, 5)), "float32", attrs=(("epsilon", 0.01),))
    assert two_axes.edge_case().shapes == ((7, 3, 37), (3, 37), (3, 37))
    assert OpSignature("rms_norm", ((3, 5), (3, 5)), "float32", attrs=(("epsilon", 0.01),)).edge_case().shapes == (
        (3, 37), (3, 37))
    assert not two_axes.kind.valid(((2, 3, 5), (3, 5), (5,)))
    x = relax.Var("x", relax.TensorType((2, 3, 5), "float32"))
    gamma = relax.Var("gamma", relax.TensorType((3,), "float32"))
    assert OP_KINDS["rms_norm"].find(relax.op.nn.rms_norm(x, gamma, axes=[1])) is None
    gamma = relax.Var("gamma", relax.TensorType((5,), "float32"))
    assert OP_KINDS["rms_norm"].find(relax.op.nn.rms_norm(x, gamma, axes=[-1])).attrs == (("epsilon", 1e-5),)
    assert OP_KINDS["rms_norm"].find(relax.op.nn.rms_norm(x, gamma, axes=[-1], epsilon=0.0)) is None


def test_attention_reference_is_softmax_of_scaled_scores():
    """The reference attention against a per-head loop written out (it is what candidates are
    checked against, so it is checked itself)."""
    sig = OpSignature("attention", ((2, 3, 2, 4), (2, 5, 2, 4), (2, 5, 2, 6), (2, 1, 1, 5)), "float32",
                      attrs=(("scale", 0.5),))
    rng = np.random.default_rng(6)
    q, k, v, bias = (rng.standard_normal(s) for s in sig.shapes)
    want = np.zeros(sig.out_shape)
    for b in range(2):
        for h in range(2):
            scores = q[b, :, h] @ k[b, :, h].T * 0.5 + bias[b, 0]
            weights = np.exp(scores) / np.exp(scores).sum(axis=1, keepdims=True)
            want[b, :, h] = weights @ v[b, :, h]
    np.testing.assert_allclose(sig.reference(q, k, v, bias), want, rtol=1e-12)
    assert sig.out_shape == (2, 3, 2, 6) and sig.kind.valid(sig.shapes)
    assert not sig.kind.valid(((2, 3, 2, 4), (2, 5, 2, 4), (2, 5, 2, 6), (2, 2, 3, 3)))


def _conv_model() -> onnx.ModelProto:
    """Conv + bias + ReLU (padded), a strided conv with bias, a grouped and dilated one with
    asymmetric padding: NCHW, batch 2, odd sizes."""
    rng = np.random.default_rng(7)
    weights = {"w1": (8, 3, 3, 3), "b1": (8,), "w2": (6, 8, 3, 3), "b2": (6,), "w3": (4, 3, 3, 3)}
    inits = [onnx.numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.3, n)
             for n, s in weights.items()]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Conv", ["c2", "w3"], ["y"], pads=[2, 1, 1, 2], dilations=[2, 2], group=2)]
    graph = helper.make_graph(nodes, "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 15, 13])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 7, 6])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


CONV_CANDIDATES = [f"library:conv_{name}" for name in CONV_ALGORITHMS]


def test_conv2d_groups_with_library_and_generated_candidates(tmp_path):
    """Each conv2d with its epilogue is an op group: each conv algorithm of the CPU library
    that can run it (unavailable ones say why) and the generated TIR are verified against the
    float64 reference (at its shape and the edge-case one), selection stores a winner for each,
    and builds taking either source compute the model as onnxruntime does."""
    from gimlet_tvm.peers import check_against_onnxruntime
    from gimlet_tvm.relax_passes.dispatch_cpu_library import CONV2D_FUNC
    from gimlet_tvm.selection.select import select_kernels

    proto = _conv_model()
    _, target = resolve_target("llvm")
    mod, _ = import_model(proto, {})
    sigs = list(op_signatures(mod, target))
    assert [sig.key for sig in sigs] == [
        "conv2d float32 2x3x15x13 * const 8x3x3x3 +1x8x1x1 relu stride 1x1 pad 1,1,1,1 dilation 1x1 groups 1",
        "conv2d float32 2x8x15x13 * const 6x8x3x3 +1x6x1x1 stride 2x2 pad 1,1,1,1 dilation 1x1 groups 1",
        "conv2d float32 2x6x8x7 * const 4x3x3x3 stride 1x1 pad 2,1,1,2 dilation 2x2 groups 2",
    ]
    for sig in sigs:
        assert OpSignature.from_json(json.loads(json.dumps(sig.to_json()))) == sig
        assert [c.id for c in candidates(sig, target)] == ["generated:tir", *CONV_CANDIDATES, "library:openblas"]
    block = direct_conv_block()
    padded, strided, grouped_dilated = ({c.id: c.unavailable for c in candidates(sig, target)} for sig in sigs)
    assert all(reasons["library:conv_im2col"] is None for reasons in (padded, strided, grouped_dilated))
    assert "default rule" in padded["library:openblas"]
    assert [padded[f"library:conv_{name}"] is None for name in ("winograd4", "winograd2", "direct8", "rows")] == [
        block >= 8] * 4
    assert (padded["library:conv_direct16"] is None) == (block >= 16)
    assert strided["library:conv_winograd4"] == strided["library:conv_winograd2"] == (
        "3x3 kernel, stride 1 and dilation 1 only")
    for name in ("direct16", "direct8", "rows"):
        assert grouped_dilated[f"library:conv_{name}"] in ("groups 1 only", padded[f"library:conv_{name}"])
    grouped = sigs[-1]
    assert grouped.edge_case().key == ("conv2d float32 1x6x13x11 * const 10x3x3x3 stride 1x1 pad 2,1,1,2 "
                                       "dilation 2x2 groups 2")
    for candidate_id in ("generated:tir", "library:openblas"):
        outcome = run_candidate(dict(_request(candidate_id, target), signature=grouped.to_json()), timeout=180)
        assert outcome.verified, outcome.reason
        assert outcome.checks == [grouped.key, grouped.edge_case().key]
    selection = select_kernels(mod, target, records=str(tmp_path), timeout=180)
    assert len(selection.choices) == 3
    for sig in sigs:
        choice = selection.choices[sig.key]
        available = {c.id for c in candidates(sig, target) if c.unavailable is None}
        assert {t.id for t in choice.tried if t.verified} == available, choice.tried
        assert all(t.verdict == "unavailable" for t in choice.tried if not t.verified)
    generated, rewritten = rewrite_ops(mod, lambda sig: find("generated:tir", sig, target), resolve_target("llvm")[1])
    assert rewritten == 3 and CONV2D_FUNC not in generated.script()
    x = {"x": np.random.default_rng(3).standard_normal((2, 3, 15, 13)).astype(np.float32)}
    for source in ("generated", "library"):
        model = gimlet_tvm.build(proto, "llvm", records=str(tmp_path), selection=selection.restricted_to(source))
        ok, diff = check_against_onnxruntime(proto, model, x, tolerance=1e-4)
        assert ok, f"{source}: {diff}"


def default_algorithm(sig: OpSignature) -> ConvAlgorithm | None:
    """The conv algorithm an untuned build runs the op group on (this CPU, no overrides)."""
    return default_conv_algorithm(signature_conv_shape(sig), direct_conv_block(), None)


@pytest.mark.parametrize("name", [*CONV_ALGORITHMS, "openblas"])
def test_a_chosen_conv_algorithm_runs_in_the_built_model(name, tmp_path):
    """Records choosing one conv algorithm for every op group of `_conv_model` it can run (odd
    channels, stride 2, padding; the others keep the default rule) land in the built model as
    that kernel's calls, which the library pass leaves alone, and the model computes what
    onnxruntime does. `library:openblas`, the conv winner older records name, still builds:
    the default rule's kernels."""
    from gimlet_tvm.compiler import kernel_passes
    from gimlet_tvm.peers import check_against_onnxruntime
    from gimlet_tvm.relax_passes.dispatch_cpu_library import CONV2D_FUNC

    proto = _conv_model()
    spec, target = resolve_target("llvm")
    mod, _ = import_model(proto, {})
    candidate_id = f"library:conv_{name}" if name in CONV_ALGORITHMS else f"library:{name}"
    groups = op_signatures(mod, target)
    chosen = {sig: count for sig, count in groups.items() if find(candidate_id, sig, target).unavailable is None}
    if name == "openblas":
        chosen = groups
    if not chosen:
        pytest.skip(f"{candidate_id} runs none of the convs on this CPU")
    KernelSelection(target_key(target), {
        sig.key: OpChoice(sig, [Tried(candidate_id, "", True, seconds=1.0)], candidate_id, count)
        for sig, count in chosen.items()}).save(tmp_path)

    def expected_func(sig: OpSignature) -> str:
        algorithm = CONV_ALGORITHMS[name] if sig in chosen and name in CONV_ALGORITHMS else default_algorithm(sig)
        return CONV2D_FUNC if algorithm is None else algorithm.func

    expected = collections.Counter(expected_func(sig) for sig in groups)
    selection = KernelSelection.load(tmp_path, target)
    with target:
        script = tvm.transform.Sequential(kernel_passes([(spec, target)], selection.pass_for(target)))(mod)["main"].script()
    conv_funcs = {CONV2D_FUNC, *(a.func for a in CONV_ALGORITHMS.values())}
    assert {func: script.count(f'"{func}"') for func in conv_funcs} == {func: expected[func] for func in conv_funcs}
    model = gimlet_tvm.build(proto, "llvm", records=str(tmp_path))
    x = {"x": np.random.default_rng(4).standard_normal((2, 3, 15, 13)).astype(np.float32)}
    ok, diff = check_against_onnxruntime(proto, model, x, tolerance=1e-4)
    assert ok, diff


def test_convs_the_library_runs_on_its_own_kernels_are_op_groups():
    """Kernel selection's grouping run leaves every conv the generic library call, so convs the
    CPU library runs on its direct or Winograd kernel (packed or transformed weights) are op
    groups too; the default rule picks those kernels for them, and a build with the default
    rule chosen (`library:openblas`, as older records name it) keeps the generic call for the
    library pass, runs them and computes the model as onnxruntime does."""
    from gimlet_tvm.peers import check_against_onnxruntime
    from gimlet_tvm.relax_passes.dispatch_cpu_library import (
        CONV2D_FUNC, DIRECT_CONV2D_FUNC, WINOGRAD_CONV2D_FUNC, direct_conv_block)

    rng = np.random.default_rng(5)
    # 68 and 36 channels: no multiples of a block, so the blocked layout leaves both convs on
    # NCHW (the first runs Winograd, the second the direct kernel), where they are op groups.
    weights = {"w1": (68, 68, 3, 3), "b1": (68,), "w2": (36, 68, 3, 3)}
    inits = [onnx.numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.05, n)
             for n, s in weights.items()]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2])]
    graph = helper.make_graph(nodes, "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 68, 28, 28])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 36, 14, 14])], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    _, target = resolve_target("llvm")
    mod, _ = import_model(proto, {})
    sigs = list(op_signatures(mod, target))
    assert [sig.key.split(" * ")[0] for sig in sigs] == ["conv2d float32 1x68x28x28", "conv2d float32 1x68x28x28"]
    block = direct_conv_block()
    expected = [WINOGRAD_CONV2D_FUNC, DIRECT_CONV2D_FUNC] if block else [CONV2D_FUNC, CONV2D_FUNC]
    assert [default_algorithm(sig).func if block else CONV2D_FUNC for sig in sigs] == expected
    library, rewritten = rewrite_ops(mod, lambda sig: find("library:openblas", sig, target), target)
    assert rewritten == 2 and library.script().count(CONV2D_FUNC) == 2
    model = gimlet_tvm.build(proto, "llvm")
    x = {"x": rng.standard_normal((1, 68, 28, 28)).astype(np.float32)}
    ok, diff = check_against_onnxruntime(proto, model, x, tolerance=1e-4)
    assert ok, diff


def test_generated_groups_run_as_measured_and_tuned():
    """A residual add of two convolutions' outputs (a ResNet shortcut): FuseOps in the model
    could fuse it into either conv, and selection's group has it in one. The generated
    candidate's kernels in the model are exactly those its tuning tasks describe (same
    MetaSchedule workloads), so selection's timing and the tuning records apply to them."""
    from tvm.s_tir import meta_schedule as ms

    from gimlet_tvm.compiler import kernel_passes
    from gimlet_tvm.tuning import generated_group_tasks

    rng = np.random.default_rng(11)
    weights = {"w1": (8, 4, 3, 3), "b1": (8,), "w2": (8, 4, 1, 1), "b2": (8,)}
    inits = [onnx.numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in weights.items()]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["main"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["x", "w2", "b2"], ["shortcut"]),
             helper.make_node("Add", ["main", "shortcut"], ["sum"]),
             helper.make_node("Relu", ["sum"], ["y"])]
    graph = helper.make_graph(nodes, "shortcut", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 9, 9])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 9, 9])], inits)
    mod, _ = import_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), {})
    spec, target = resolve_target("llvm")
    groups = op_signatures(mod, target)
    assert len(groups) == 2
    tuned = {task.workload[0] for task in generated_group_tasks(groups, "llvm")}
    generated_only = KernelSelection(target_key(target), {
        sig.key: OpChoice(sig, [Tried("generated:tir", "", True, seconds=1.0)], "generated:tir", count)
        for sig, count in groups.items()}, None, "", "local")
    with target:
        built = tvm.transform.Sequential(kernel_passes([(spec, target)], generated_only.pass_for(target)))(mod)
        kernels = [ms.database.Workload(t.dispatched[0]).as_json()[0]
                   for t in ms.relax_integration.extract_tasks(built, target)]
    assert len(kernels) == 2 and set(kernels) == tuned


def test_generated_lone_op_still_fuses_what_follows():
    """A depthwise conv (the library does not take it: an op group without epilogue) chosen as
    generated TIR stays open to FuseOps: its bias add and ReLU still run in its kernel."""
    from tvm.s_tir import meta_schedule as ms

    from gimlet_tvm.compiler import kernel_passes

    rng = np.random.default_rng(12)
    inits = [onnx.numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in {"w": (6, 1, 3, 3), "b": (6,)}.items()]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], group=6),
             helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "depthwise", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 9, 9])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 9, 9])], inits)
    mod, _ = import_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), {})
    spec, target = resolve_target("llvm")
    (sig,) = op_signatures(mod, target)
    assert sig.epilogue == () and sig.attrs[-1] == ("groups", 6.0)
    assert [c.id for c in candidates(sig, target) if c.unavailable is None] == ["generated:tir"]
    chosen = KernelSelection(target_key(target), {sig.key: OpChoice(
        sig, [Tried("generated:tir", "", True, seconds=1.0)], "generated:tir")}, None, "", "local")
    with target:
        built = tvm.transform.Sequential(kernel_passes([(spec, target)], chosen.pass_for(target)))(mod)
        (kernel,) = [t.task_name for t in ms.relax_integration.extract_tasks(built, target)]
    assert "conv2d" in kernel and "relu" in kernel, kernel


def test_multiply_adds_order_selection_by_work():
    """Selection starts with the groups of most work (a time budget then cuts the least):
    a conv's multiply-adds are outputs x input channels per group x kernel, a matmul's M x N x K,
    attention's both products."""
    conv_attrs = tuple(zip(("stride_h", "stride_w", "pad_top", "pad_left", "pad_bottom", "pad_right",
                            "dilation_h", "dilation_w", "groups"), (2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0)))
    conv = OpSignature("conv2d", ((1, 8, 9, 9), (6, 4, 3, 3)), "float32", attrs=conv_attrs)
    assert conv.out_shape == (1, 6, 5, 5) and conv.multiply_adds == 6 * 5 * 5 * 4 * 3 * 3
    assert SIG.multiply_adds == M * N * K
    attention = OpSignature("attention", ((1, 4, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8)), "float32",
                            attrs=(("scale", 0.5),))
    assert attention.multiply_adds == 1 * 4 * 2 * 8 * (6 + 6)
