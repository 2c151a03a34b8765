"""gimlet's CPU library: the OpenBLAS extension and the Relax pass that dispatches to it.

Each case compiles with the llvm target's default pipeline (library dispatch, legalization,
fusion, default schedules) and compares with numpy or onnxruntime.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
import tvm
from onnx import TensorProto, helper
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx

from gimlet_tvm.compiler import relax_pipeline
from gimlet_tvm.relax_passes.dispatch_cpu_library import (
    CONV2D_FUNC, DEPTHWISE_CONV2D_FUNC, DIRECT_CONV2D_FUNC, DIRECT_CONV_BLOCK_ENV, MATMUL_FUNC,
    ROW_CONV2D_FUNC, WINOGRAD_CONV2D_FUNC, DispatchCPULibrary, library_matmul)
from gimlet_tvm.runtime.extensions import load_extensions
from gimlet_tvm.targets.llvm import LLVM_CPU

TARGET = LLVM_CPU.make_target()


def build(mod: tvm.IRModule) -> relax.VirtualMachine:
    """Compile `mod` with the llvm target's default pipeline."""
    with TARGET:
        executable = tvm.compile(mod, TARGET, relax_pipeline=relax_pipeline(LLVM_CPU, TARGET))
    return relax.VirtualMachine(executable, tvm.cpu())


def packed_calls(mod: tvm.IRModule) -> list[str]:
    """Names of the packed functions `call_dps_packed` calls in `main` after dispatch."""
    script = DispatchCPULibrary()(mod).script()
    return [name for name in (MATMUL_FUNC, CONV2D_FUNC, DIRECT_CONV2D_FUNC, ROW_CONV2D_FUNC,
                              WINOGRAD_CONV2D_FUNC, DEPTHWISE_CONV2D_FUNC)
            for _ in range(script.count(f'"{name}"'))]


def onnx_model(
    nodes: list[onnx.NodeProto],
    inputs: list[tuple[str, list]],
    output: tuple[str, list],
    initializers: dict[str, np.ndarray],
) -> onnx.ModelProto:
    """A float32 opset-17 model; shapes may name symbolic axes."""
    graph = helper.make_graph(
        nodes,
        "test",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(output[0], TensorProto.FLOAT, output[1])],
        [onnx.numpy_helper.from_array(v, k) for k, v in initializers.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def run_both(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(ours, onnxruntime's) outputs of `model` on `inputs`."""
    mod = from_onnx(model, keep_params_in_input=False)
    vm = build(mod)
    ours = vm["main"](*(tvm.runtime.tensor(v) for v in inputs.values())).numpy()
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 2
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return ours, session.run(None, inputs)[0]


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    """Standard-normal float32 data."""
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


@pytest.mark.parametrize(
    "a_shape, b_shape",
    [
        ((37, 53), (53, 29)),  # not a multiple of any tile
        ((2, 3, 17, 8), (8, 5)),  # batch axes folded into M
        ((4, 17, 8), (4, 8, 5)),  # batched
        ((2, 1, 6, 8), (3, 8, 5)),  # batch axes broadcast both ways
        ((1, 6, 8), (3, 2, 8, 5)),  # b has more batch axes
        ((1, 512), (512, 1000)),  # one row (a GEMV), its columns split across threads
        ((3, 1, 40), (3, 40, 9)),  # batched one-row products
    ],
)
def test_matmul_against_numpy(a_shape: tuple, b_shape: tuple) -> None:
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType(a_shape, "float32"))
    b = relax.Var("b", relax.TensorType(b_shape, "float32"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(a, b))
        bb.emit_func_output(out)
    mod = bb.get()
    assert packed_calls(mod) == [MATMUL_FUNC]
    a_np, b_np = rand(*a_shape, seed=1), rand(*b_shape, seed=2)
    out = build(mod)["main"](tvm.runtime.tensor(a_np), tvm.runtime.tensor(b_np)).numpy()
    np.testing.assert_allclose(out, a_np @ b_np, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows, k, n", [(7, 33, 19), (1, 600, 900)])
def test_transposed_weight_matmul_with_symbolic_batch(rows: int, k: int, n: int) -> None:
    """x @ permute_dims(w) becomes one call with transpose_b; the batch axis stays symbolic.
    One row at batch 1 is a GEMV over w's rows (600 x 900: split across threads)."""
    batch = tvm.tirx.Var("batch", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((batch, rows, k), "float32"))
    w_np = rand(n, k, seed=3)
    with bb.function("main", [x]):
        with bb.dataflow():
            w_t = bb.emit(relax.op.permute_dims(relax.const(w_np)))
            out = bb.emit_output(relax.op.matmul(x, w_t))
        bb.emit_func_output(out)
    mod = bb.get()
    dispatched = DispatchCPULibrary()(mod)
    assert "permute_dims" not in dispatched.script()
    assert packed_calls(mod) == [MATMUL_FUNC]
    vm = build(mod)
    for batch_size in (1, 8):
        x_np = rand(batch_size, rows, k, seed=batch_size)
        out = vm["main"](tvm.runtime.tensor(x_np)).numpy()
        np.testing.assert_allclose(out, x_np @ w_np.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [37, 600])
def test_skinny_transposed_matmul_every_row_count(k: int) -> None:
    """Each row count of the skinny kernel (1-8, one template each) and the first past it (9:
    OpenBLAS), with K not a multiple of the vector width and N split across threads."""
    load_extensions()
    matmul = tvm.get_global_func(MATMUL_FUNC)
    w = rand(300, k, seed=7)
    for rows in range(1, 10):
        x = rand(rows, k, seed=rows)
        out = tvm.runtime.tensor(np.full((rows, 300), np.nan, np.float32))
        matmul(tvm.runtime.tensor(x), tvm.runtime.tensor(w), 1, out)
        np.testing.assert_allclose(out.numpy(), x @ w.T, rtol=1e-4, atol=1e-4, err_msg=f"{rows} rows")


@pytest.mark.parametrize("trans_b", [0, 1])
def test_one_row_by_a_constant_weight_streams_its_rows(trans_b: int) -> None:
    """A classifier at batch 1: x [1, K] by a constant weight runs as dot products over the
    weight's rows (transpose_b, the weight transposed at build time) whichever way the model
    stores it; two rows keep the weight as it is."""
    k, n = 300, 250
    weight = rand(n, k, seed=8) if trans_b else rand(k, n, seed=8)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=trans_b)]
    for rows in (1, 2):
        model = onnx_model(nodes, [("x", [rows, k])], ("y", [rows, n]), {"w": weight, "b": rand(n, seed=9)})
        dispatched = DispatchCPULibrary()(from_onnx(model, keep_params_in_input=False))
        exprs = []
        relax.analysis.post_order_visit(dispatched["main"].body, exprs.append)
        matmuls = [parts for parts in map(library_matmul, exprs) if parts is not None]
        assert [transpose for _, _, transpose, _ in matmuls] == [rows == 1 or trans_b == 1]
        ours, reference = run_both(model, {"x": rand(rows, k, seed=rows)})
        np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)


def test_unsupported_ops_stay() -> None:
    """fp16 matmul, rank-1 operands and NHWC conv2d are not rewritten."""
    bb = relax.BlockBuilder()
    h = relax.Var("h", relax.TensorType((4, 8), "float16"))
    v = relax.Var("v", relax.TensorType((8,), "float32"))
    m = relax.Var("m", relax.TensorType((4, 8), "float32"))
    img = relax.Var("img", relax.TensorType((1, 8, 8, 3), "float32"))
    ker = relax.Var("ker", relax.TensorType((4, 3, 3, 3), "float32"))
    with bb.function("main", [h, v, m, img, ker]):
        with bb.dataflow():
            bb.emit(relax.op.matmul(h, relax.op.permute_dims(h)))
            bb.emit(relax.op.matmul(m, v))
            out = bb.emit_output(relax.op.nn.conv2d(img, ker, data_layout="NHWC"))
        bb.emit_func_output(out)
    assert packed_calls(bb.get()) == []


def test_mlp_against_onnxruntime() -> None:
    """Gemm (transB) and MatMul layers with bias and Relu, batch not a multiple of 8."""
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["m"]),
        helper.make_node("Add", ["m", "b2"], ["y"]),
    ]
    weights = {"w1": rand(96, 70, seed=4), "b1": rand(96, seed=5), "w2": rand(96, 45, seed=6),
               "b2": rand(45, seed=7)}
    model = onnx_model(nodes, [("x", ["batch", 70])], ("y", ["batch", 45]), weights)
    for batch in (1, 8):
        ours, reference = run_both(model, {"x": rand(batch, 70, seed=batch)})
        np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)


def test_attention_batched_matmuls_against_onnxruntime() -> None:
    """Q @ K^T and P @ V over [batch, heads] with a symbolic batch."""
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"]),
    ]
    shape = ["batch", 3, 13, 16]
    model = onnx_model(nodes, [("q", shape), ("k", shape), ("v", shape)], ("y", shape), {})
    for batch in (1, 8):
        inputs = {name: rand(batch, 3, 13, 16, seed=i) for i, name in enumerate("qkv")}
        ours, reference = run_both(model, inputs)
        np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "in_channels, out_channels, kernel, strides, pads, dilations, group, size",
    [
        (3, 8, 3, [1, 1], [1, 1, 1, 1], [1, 1], 1, 15),
        (5, 7, 3, [2, 2], [1, 0, 2, 1], [1, 1], 1, 17),  # strided, asymmetric padding
        (4, 6, 3, [1, 2], [2, 2, 2, 2], [2, 2], 1, 13),  # dilated
        (6, 9, 1, [1, 1], [0, 0, 0, 0], [1, 1], 1, 11),  # pointwise (no im2col)
        (8, 12, 3, [1, 1], [1, 1, 1, 1], [1, 1], 4, 9),  # grouped
        (8, 8, 3, [2, 2], [1, 1, 1, 1], [1, 1], 8, 12),  # depthwise: stays in TIR
        (3, 16, 7, [2, 2], [3, 3, 3, 3], [1, 1], 1, 31),  # ResNet stem
    ],
)
def test_conv2d_against_onnxruntime(
    in_channels: int, out_channels: int, kernel: int, strides: list, pads: list,
    dilations: list, group: int, size: int, monkeypatch,
) -> None:
    """im2col + OpenBLAS (the direct kernel is turned off: tests/test_cpu_direct_conv.py)."""
    monkeypatch.setenv(DIRECT_CONV_BLOCK_ENV, "0")
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=strides, pads=pads,
                         dilations=dilations, group=group, kernel_shape=[kernel, kernel]),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    weights = {"w": rand(out_channels, in_channels // group, kernel, kernel, seed=8),
               "b": rand(out_channels, seed=9)}
    model = onnx_model(nodes, [("x", ["batch", in_channels, size, size])], ("y", None), weights)
    mod = from_onnx(model, keep_params_in_input=False)
    assert packed_calls(mod) == ([] if group == in_channels else [CONV2D_FUNC])
    for batch in (1, 8):
        ours, reference = run_both(model, {"x": rand(batch, in_channels, size, size, seed=batch)})
        np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)


def test_extensions_load_once(tmp_path, monkeypatch) -> None:
    """A second load is a no-op; a fresh cache directory gets one built library."""
    from gimlet_tvm.runtime import extensions

    load_extensions()
    assert tvm.get_global_func(MATMUL_FUNC) is not None
    monkeypatch.setenv("GIMLET_TVM_CACHE", str(tmp_path))
    library = extensions.build_extensions()
    assert library.parent == tmp_path and library.exists()
    assert extensions.build_extensions() == library
    assert [p.name for p in tmp_path.glob("*.so")] == [library.name]
