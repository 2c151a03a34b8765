"""Vulkan: SPIR-V from our GLSL printer, run by our Vulkan runtime on a real device (lavapipe
here), compared with onnxruntime; device limits, missing devices and invalid shaders are
reported by name.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
import scipy.special
import tvm
from onnx import TensorProto, helper
from tvm import relax, topi
from tvm.script import tirx as T

import gimlet_tvm
from gimlet_tvm.compiler import compile_alone
from gimlet_tvm.errors import CodeCheckError, CompileError, TargetUnavailableError
from gimlet_tvm.models import SUITE
from gimlet_tvm.runtime.vulkan_runtime import vulkan_devices
from gimlet_tvm.targets import lookup
from gimlet_tvm.targets.gpu import device_modules
from gimlet_tvm.targets.toolchain import run_tool
from gimlet_tvm.targets.vulkan import validate_module
from gimlet_tvm.targets.vulkan_codegen import Kernel, compile_glsl

from .conftest import TEST_MODELS, assert_matches, onnxruntime_outputs, suite_model

SPEC, _ = lookup("vulkan")


@functools.lru_cache(maxsize=None)
def vulkan_model(name: str) -> gimlet_tvm.CompiledModel:
    return gimlet_tvm.build(suite_model(name), "vulkan")


def build_kernel(func: tvm.tirx.PrimFunc, **target_overrides):
    """Compile one TIR kernel for Vulkan through the target's hooks; returns the executable."""
    target = SPEC.make_target(target_overrides)
    with target, SPEC.codegen_hooks(target):
        return tvm.compile(tvm.IRModule({"main": func}), target=target)


def test_vulkan_device_is_present() -> None:
    assert SPEC.can_run() is None
    assert tvm.vulkan(0).exist


@pytest.mark.parametrize("name", TEST_MODELS)
@pytest.mark.parametrize("batch", [1, 8])
def test_model_suite_matches_onnxruntime(name: str, batch: int) -> None:
    model = vulkan_model(name)
    inputs = SUITE[name].example_inputs(batch=batch, seed=batch)
    assert_matches(model(*inputs.values()), onnxruntime_outputs(suite_model(name), inputs))


def test_device_code_is_validated_spirv() -> None:
    model = vulkan_model("transformer_encoder")
    code = model.targets[0]["device_code"]
    assert code["format"] == "SPIR-V (vulkan1.1, from GLSL 450)"
    assert code["checked_with"] == "spirv-val"
    assert len(code["kernels"]) >= 3 and all(k.endswith("_kernel") for k in code["kernels"])


def test_export_and_load_round_trip(tmp_path) -> None:
    model = vulkan_model("resnet_cnn")
    path = tmp_path / "resnet.so"
    model.export(path)
    loaded = gimlet_tvm.load(path)
    assert loaded.metadata["targets"] == model.targets
    inputs = SUITE["resnet_cnn"].example_inputs(batch=2)
    assert_matches(loaded(*inputs.values()), onnxruntime_outputs(suite_model("resnet_cnn"), inputs))


def test_device_facts_come_from_the_driver() -> None:
    device = vulkan_devices()["devices"][0]
    dev = tvm.vulkan(0)
    assert dev.device_name == device["name"]
    assert dev.max_threads_per_block == device["max_workgroup_invocations"]
    assert dev.max_shared_memory_per_block == device["max_shared_memory"]
    assert dev.warp_size == device["subgroup_size"]
    facts = SPEC.facts()
    assert facts["device"] == device["name"]
    assert facts["shared_memory_per_block"] == device["max_shared_memory"]
    assert facts["max_threads_per_block"] <= device["max_workgroup_invocations"]


def _carried_outer_products(batch: list[int], steps: int) -> onnx.ModelProto:
    """`state += k_t^T v_t; out_t = q_t state` for t < steps, unrolled (what the Scan converter
    makes of LinearAttention): matmuls with an inner dimension of 1 followed by an add."""

    def tensor(name: str, *shape: int) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [*batch, *shape])

    nodes, inputs, outputs, state = [], [tensor("state", 8, 8)], [], "state"
    for t in range(steps):
        nodes += [
            helper.make_node("MatMul", [f"k{t}", f"v{t}"], [f"outer{t}"]),
            helper.make_node("Add", [state, f"outer{t}"], [f"state{t}"]),
            helper.make_node("MatMul", [f"q{t}", f"state{t}"], [f"out{t}"]),
        ]
        state = f"state{t}"
        inputs += [tensor(f"q{t}", 1, 8), tensor(f"k{t}", 8, 1), tensor(f"v{t}", 1, 8)]
        outputs.append(tensor(f"out{t}", 1, 8))
    outputs.append(tensor(state, 8, 8))
    graph = helper.make_graph(nodes, "carried_outer_products", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("batch", [[2, 4], [4]])
def test_reduction_over_one_element_with_epilogue_matches_onnxruntime(batch: list[int]) -> None:
    # DLight inlined the Add into both the init and the update of the K=1 matmul, adding the
    # carried state twice (batch [2, 4]: wrong results; [4]: an AssertionError in DLight's GEMV
    # analysis). Step 0 of LinearAttention starts from zeros, so only later steps were wrong.
    model = _carried_outer_products(batch, steps=3)
    rng = np.random.default_rng(0)
    inputs = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
              .astype("float32") for i in model.graph.input}
    ours = gimlet_tvm.build(model, "vulkan")(*inputs.values())
    assert_matches(ours, onnxruntime_outputs(model, inputs))


def _one_op_model(node: onnx.NodeProto, inputs: list[onnx.ValueInfoProto],
                  outputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
    graph = helper.make_graph([node], node.op_type, inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("axis", [0, 1])
def test_cumsum_runs_on_device_threads(axis: int) -> None:
    # TOPI's generic cumsum (an opaque block with a parallel loop) was left unscheduled and
    # compiled as host code that dereferenced the VulkanBuffer handles: crashes, garbage.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [300, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [300, 5])
    axis_value = helper.make_tensor("axis", TensorProto.INT64, [], [axis])
    model = _one_op_model(helper.make_node("CumSum", ["x", "axis"], ["y"], reverse=1), [x], [y])
    model.graph.initializer.append(axis_value)
    inputs = {"x": np.random.default_rng(axis).standard_normal((300, 5)).astype("float32")}
    ours = gimlet_tvm.build(model, "vulkan")(inputs["x"])
    assert_matches(ours, onnxruntime_outputs(model, inputs))


@pytest.mark.parametrize("largest", [0, 1])
def test_topk_sorts_on_the_device(largest: int) -> None:
    # TopK's argsort was TOPI's generic one, a CPU library call that read device memory.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 300])
    k = helper.make_tensor_value_info("k", TensorProto.INT64, [1])
    values = helper.make_tensor_value_info("values", TensorProto.FLOAT, [3, 7])
    indices = helper.make_tensor_value_info("indices", TensorProto.INT64, [3, 7])
    node = helper.make_node("TopK", ["x", "k"], ["values", "indices"], largest=largest)
    model = _one_op_model(node, [x, k], [values, indices])
    data = np.random.default_rng(largest).integers(0, 20, (3, 300)).astype("float32")  # ties
    inputs = {"x": data, "k": np.array([7], "int64")}
    ours = gimlet_tvm.build(model, "vulkan")(*inputs.values())
    assert_matches(ours, onnxruntime_outputs(model, inputs))


def test_host_library_call_is_refused_at_compile_time() -> None:
    x = relax.Var("x", relax.TensorType((3, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            order = bb.emit_output(bb.emit_te(topi.argsort, x, axis=1, dtype="int64"))
        bb.emit_func_output(order)
    with pytest.raises(RuntimeError, match="unsupported on vulkan: .*tvm.contrib.sort.argsort"):
        compile_alone(bb.get(), (SPEC, SPEC.make_target()))


@pytest.mark.parametrize("k", [576, 150])
def test_linear_layer_reduces_per_thread_on_a_cpu_device(k: int) -> None:
    """A linear layer (`x @ w.T + r`, rows symbolic) is one kernel reading `w` in place; on a
    CPU device each thread reduces a whole output element, without shared memory, from vector
    loads where the reduction length allows them."""
    rows = tvm.tirx.Var("rows", "int64")
    x = relax.Var("x", relax.TensorType((rows, k), "float32"))
    w = relax.Var("w", relax.TensorType((192, k), "float32"))
    r = relax.Var("r", relax.TensorType((rows, 192), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, r]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w)))
            out = bb.emit_output(bb.emit(relax.op.add(y, r)))
        bb.emit_func_output(out)
    target = SPEC.make_target()
    assert target.attrs["device_type"] == "cpu"
    ex = compile_alone(bb.get(), (SPEC, target))
    source = "\n".join(m.inspect_source("") for m in device_modules(ex.mod, "vulkan"))
    kernels = [line for line in source.splitlines() if line.startswith("// kernel ")]
    assert kernels == ["// kernel fused_matmul_transposed_add_kernel"]
    assert "shared " not in source and "barrier()" not in source
    assert ("vec4 data[]" in source) == (k % 4 == 0)
    rng = np.random.default_rng(k)
    xs, ws, rs = (rng.standard_normal(shape, dtype="float32") for shape in ((5, k), (192, k), (5, 192)))
    dev = tvm.vulkan(0)
    vm = relax.VirtualMachine(ex, dev)
    got = vm["main"](*(tvm.runtime.tensor(a, dev) for a in (xs, ws, rs))).numpy()
    np.testing.assert_allclose(got, xs @ ws.T + rs, rtol=1e-5, atol=1e-4)


def test_linear_layer_with_the_weight_made_after_the_activations() -> None:
    """`x @ permute_dims(w)` with `w` computed in the graph after `x` (as in ONNX GRU/LSTM's
    recurrent products, which TVM's FuseTransposeMatmul failed to compile: the conformance
    subset runs them) is one kernel, and it multiplies x by w^T (square: a swap would not
    fail to compile)."""
    a = relax.Var("a", relax.TensorType((8, 8), "float32"))
    b = relax.Var("b", relax.TensorType((8, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            x = bb.emit(relax.op.add(a, a))
            w = bb.emit(relax.op.multiply(b, b))
            out = bb.emit_output(bb.emit(relax.op.matmul(x, relax.op.permute_dims(w))))
        bb.emit_func_output(out)
    ex = compile_alone(bb.get(), (SPEC, SPEC.make_target()))
    source = "\n".join(m.inspect_source("") for m in device_modules(ex.mod, "vulkan"))
    assert "matmul_transposed" in source and "transpose" not in source.replace("matmul_transposed", "")
    rng = np.random.default_rng(0)
    an, bn = rng.standard_normal((8, 8), dtype="float32"), rng.standard_normal((8, 8), dtype="float32")
    dev = tvm.vulkan(0)
    got = relax.VirtualMachine(ex, dev)["main"](tvm.runtime.tensor(an, dev), tvm.runtime.tensor(bn, dev)).numpy()
    np.testing.assert_allclose(got, (an + an) @ (bn * bn).T, rtol=1e-5, atol=1e-4)


@T.prim_func
def _math(a: T.Buffer((1024,), "float32"), erf: T.Buffer((1024,), "float32"),
          tanh: T.Buffer((1024,), "float32"), cube: T.Buffer((1024,), "float32"),
          exp: T.Buffer((1024,), "float32"), q: T.Buffer((1024,), "int64"),
          r: T.Buffer((1024,), "int64")):
    for i in T.thread_binding(8, thread="blockIdx.x"):
        for j in T.thread_binding(128, thread="threadIdx.x"):
            erf[i * 128 + j] = T.erf(a[i * 128 + j])
            tanh[i * 128 + j] = T.tanh(a[i * 128 + j])
            cube[i * 128 + j] = T.pow(a[i * 128 + j], T.float32(3.0))
            exp[i * 128 + j] = T.exp(a[i * 128 + j])
            q[i * 128 + j] = T.floordiv(T.int64(i * 128 + j) - T.int64(512), T.int64(7))
            r[i * 128 + j] = T.floormod(T.int64(i * 128 + j) - T.int64(512), T.int64(7))


def test_math_builtins_match_numpy() -> None:
    ex = build_kernel(_math)
    dev = tvm.vulkan(0)
    x = np.linspace(-12, 12, 1024).astype("float32")
    args = [tvm.runtime.tensor(x, dev)]
    args += [tvm.runtime.empty((1024,), "float32", dev) for _ in range(4)]
    args += [tvm.runtime.empty((1024,), "int64", dev) for _ in range(2)]
    ex["main"](*args)
    erf, tanh, cube, exp, q, r = (a.numpy() for a in args[1:])
    x64 = x.astype("float64")
    np.testing.assert_allclose(erf, scipy.special.erf(x64), rtol=1e-6, atol=5e-7)
    np.testing.assert_allclose(tanh, np.tanh(x64), rtol=1e-6, atol=5e-7)
    np.testing.assert_allclose(cube, x64**3, rtol=2e-6)  # C pow semantics for negative bases
    np.testing.assert_allclose(exp, np.exp(x64), rtol=2e-6)
    n = np.arange(1024) - 512
    np.testing.assert_array_equal(q, n // 7)
    np.testing.assert_array_equal(r, n % 7)


@T.prim_func
def _vectors(a: T.Buffer((512,), "float32"), b: T.Buffer((512,), "float32"),
             picked: T.Buffer((512,), "float32"), cube: T.Buffer((512,), "float32"),
             reversed_next: T.Buffer((512,), "float32"), q: T.Buffer((512,), "int64"),
             either_not_positive: T.Buffer((512,), "bool")):
    # Four lanes per thread, as the KV cache's attention kernels use them: index vectors (Ramp)
    # into scalar buffers, float32x4 shared and local arrays, lane-wise compare/select/pow.
    for i in T.thread_binding(4, thread="blockIdx.x"):
        for j in T.thread_binding(32, thread="threadIdx.x"):
            tile = T.alloc_buffer((32,), "float32x4", scope="shared")
            half = T.alloc_buffer((1,), "float32x4", scope="local")
            lanes = T.Ramp(i * 128 + j * 4, 1, 4)
            tile[j] = a[lanes]
            half[0] = T.Broadcast(T.float32(0.5), 4) * b[lanes]
            T.tvm_storage_sync("shared")
            picked[lanes] = T.Select(a[lanes] < b[lanes], a[lanes], half[0])
            cube[lanes] = T.pow(a[lanes], T.Broadcast(T.float32(3.0), 4))
            reversed_next[lanes] = T.Shuffle([tile[(j + 1) % 32]], [3, 2, 1, 0])
            q[lanes] = T.floordiv(T.Ramp(T.int64(i * 128 + j * 4) - T.int64(256), T.int64(1), 4),
                                  T.Broadcast(T.int64(7), 4))
            either_not_positive[lanes] = T.Not(T.And(a[lanes] > T.Broadcast(T.float32(0.0), 4),
                                                     b[lanes] > T.Broadcast(T.float32(0.0), 4)))


def test_vector_lanes_match_numpy() -> None:
    ex = build_kernel(_vectors)
    dev = tvm.vulkan(0)
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal(512).astype("float32") for _ in range(2))
    args = [tvm.runtime.tensor(x, dev), tvm.runtime.tensor(y, dev)]
    args += [tvm.runtime.empty((512,), "float32", dev) for _ in range(3)]
    args += [tvm.runtime.empty((512,), "int64", dev), tvm.runtime.empty((512,), "bool", dev)]
    ex["main"](*args)
    picked, cube, reversed_next, q, either_not_positive = (t.numpy() for t in args[2:])
    np.testing.assert_array_equal(picked, np.where(x < y, x, 0.5 * y))
    np.testing.assert_allclose(cube, x.astype("float64") ** 3, rtol=2e-6)
    rows = x.reshape(4, 32, 4)
    np.testing.assert_array_equal(reversed_next, np.roll(rows, -1, axis=1)[:, :, ::-1].reshape(-1))
    np.testing.assert_array_equal(q, (np.arange(512) - 256) // 7)
    np.testing.assert_array_equal(either_not_positive, (x <= 0) | (y <= 0))


def test_attention_state_merge_is_race_free_at_head_dim_64() -> None:
    # TVM's in-place merge (its paged KV cache's) has the 16 threads of a head read S and then
    # write it with no barrier: lavapipe's 8-wide subgroups merged twice. The spec swaps in ours.
    from tvm.relax.frontend.nn.llm._decode_kernels import _merge_state_inplace

    tvms = _merge_state_inplace(9, 64, "float32", SPEC.make_target(), "tir_attention_merge_state")
    fixed = SPEC.fix_library_kernels(tvm.IRModule({"tir_attention_merge_state": tvms}))
    assert "tvm_storage_sync" not in tvms.script()
    assert "tvm_storage_sync" in fixed["tir_attention_merge_state"].script()
    ex = build_kernel(fixed["tir_attention_merge_state"])
    rng = np.random.default_rng(0)
    v, v_other = (rng.standard_normal((5, 9, 64)).astype("float32") for _ in range(2))
    s, s_other = (3 * rng.standard_normal((5, 9)).astype("float32") for _ in range(2))
    args = [tvm.runtime.tensor(a, tvm.vulkan(0)) for a in (v, s, v_other, s_other)]
    ex["main"](*args)
    top = np.maximum(s, s_other)
    w, w_other = np.exp2(s - top), np.exp2(s_other - top)
    want = (v * w[..., None] + v_other * w_other[..., None]) / (w + w_other)[..., None]
    np.testing.assert_allclose(args[0].numpy(), want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(args[1].numpy(), np.log2(w + w_other) + top, atol=1e-5, rtol=0)


@T.prim_func
def _wide(a: T.Buffer((4096,), "float32"), b: T.Buffer((4096,), "float32")):
    # 64 x 32 = 2048 invocations per workgroup: each dimension fits, the total does not.
    for i in T.thread_binding(2, thread="blockIdx.x"):
        for y in T.thread_binding(32, thread="threadIdx.y"):
            for x in T.thread_binding(64, thread="threadIdx.x"):
                b[i * 2048 + y * 64 + x] = a[i * 2048 + y * 64 + x] + T.float32(1.0)


def test_workgroup_over_target_limit_fails_at_codegen() -> None:
    # TVM re-raises our VulkanCodegenError as a RuntimeError across its FFI boundary.
    with pytest.raises(RuntimeError, match=r"kernel '_wide_kernel'.*2048 threads \(64x32x1\)"
                                           r".*max_num_threads=256"):
        build_kernel(_wide)


def test_workgroup_over_device_limit_fails_at_launch() -> None:
    ex = build_kernel(_wide, max_num_threads=4096, max_threads_per_block=4096)
    dev = tvm.vulkan(0)
    a, b = (tvm.runtime.empty((4096,), "float32", dev) for _ in range(2))
    with pytest.raises(RuntimeError, match=r"Vulkan kernel '_wide_kernel' exceeds the limits of "
                                           r"device .*2048 invocations.*maxComputeWorkGroupInvocations"):
        ex["main"](a, b)


@T.prim_func
def _big_grid(a: T.Buffer((300000,), "float32"), b: T.Buffer((300000,), "float32")):
    for i in T.thread_binding(150000, thread="blockIdx.x"):
        for j in T.thread_binding(2, thread="threadIdx.x"):
            b[i * 2 + j] = a[i * 2 + j] * T.float32(2.0)


def test_grid_beyond_max_workgroup_count_is_folded() -> None:
    ex = build_kernel(_big_grid)  # 150000 workgroups; lavapipe allows 65535 per dimension
    dev = tvm.vulkan(0)
    x = np.random.default_rng(0).standard_normal(300000).astype("float32")
    a, b = tvm.runtime.tensor(x, dev), tvm.runtime.empty((300000,), "float32", dev)
    ex["main"](a, b)
    np.testing.assert_array_equal(b.numpy(), x * 2)


def test_invalid_spirv_names_the_kernel(tmp_path) -> None:
    model = vulkan_model("mlp")
    (module,) = device_modules(model._module, "vulkan")
    spirv = tvm.get_global_func("gimlet.vulkan.module_spirv")(module)
    name = sorted(spirv.keys())[0]
    # Corrupt one kernel: an integer add on float operands is invalid SPIR-V.
    binary = tmp_path / "k.spv"
    binary.write_bytes(bytes(spirv[name]))
    text = run_tool(["spirv-dis", str(binary)], "disassembling")
    assert "OpFAdd" in text
    (tmp_path / "bad.spvasm").write_text(text.replace("OpFAdd", "OpIAdd", 1))
    run_tool(["spirv-as", str(tmp_path / "bad.spvasm"), "-o", str(binary)], "assembling")
    description = {"kernels": [{"name": name, "num_buffers": 1, "scalars": [],
                                "launch_params": [], "workgroup": [1, 1, 1], "shared_bytes": 0}],
                   "source": ""}
    bad = tvm.get_global_func("gimlet.vulkan.module_create")(
        json.dumps(description), [bytearray(binary.read_bytes())]
    )
    with pytest.raises(CodeCheckError, match=f"kernel '{name}' fails SPIR-V validation"):
        validate_module(bad)
    assert validate_module(module) == set(spirv.keys())


def test_glsl_compile_error_names_the_kernel() -> None:
    kernel = Kernel("broken_kernel", "#version 450\nvoid main() { undefined_call(); }\n",
                    0, [], [], [1, 1, 1], 0)
    with pytest.raises(CompileError, match="kernel 'broken_kernel'.*undefined_call"):
        compile_glsl(kernel)


def test_no_vulkan_device_is_a_clear_error(tmp_path) -> None:
    script = textwrap.dedent(
        """
        import numpy as np
        import gimlet_tvm
        from gimlet_tvm.errors import TargetUnavailableError
        from gimlet_tvm.models import SUITE
        from gimlet_tvm.targets import lookup

        spec, _ = lookup("vulkan")
        print("REASON", spec.can_run())
        model = gimlet_tvm.build(SUITE["mlp"].build(), "vulkan")  # cross-compiles
        print("TARGET", model.targets[0]["target"]["max_shared_memory_per_block"])
        try:
            model(np.zeros((1, 1024), "float32"))
        except TargetUnavailableError as err:
            print("RUN", err)
        """
    )
    env = {**os.environ, "VK_ICD_FILENAMES": str(tmp_path / "no-such-icd.json")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REASON cannot create a Vulkan instance" in proc.stdout
    assert "TARGET 16384" in proc.stdout  # Vulkan's guaranteed minimum, not this machine's
    assert "RUN target 'vulkan' cannot run on this machine: cannot create a Vulkan instance" in proc.stdout
