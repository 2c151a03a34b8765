"""Graph-level fusion (relax_passes/graph_fusion.py): each pattern, written in ONNX, becomes one
fused op and fewer kernels, and still matches onnxruntime; near misses stay unfused and correct.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import onnx
import pytest
import tvm
from onnx import helper
from tvm import relax
from tvm.relax.global_info import VDevice

import gimlet_tvm
from gimlet_tvm.compiler import canonicalize_passes, device_pipeline, fusion_passes, resolve_devices, resolve_target
from gimlet_tvm.frontend import import_model
from gimlet_tvm.relax_passes.blocked_layout import BLOCKED_LAYOUT_ENV
from gimlet_tvm.relax_passes.dispatch_cpu_library import MATMUL_FUNC, DispatchCPULibrary
from gimlet_tvm.relax_passes.graph_fusion import (
    count_kernel_launches,
    graph_fusion_disabled,
    graph_fusion_passes,
)

from .conftest import assert_matches, onnxruntime_outputs
from .test_cpu_library import onnx_model, rand


@pytest.fixture(autouse=True)
def nchw_convs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel counts here are of NCHW graphs: on a CPU whose channel block is 8 (AVX2), the
    8- and 16-channel convs would run in the blocked layout, which adds its conversions at the
    region's edges to every count (tests/test_cpu_blocked_conv.py counts those)."""
    monkeypatch.setenv(BLOCKED_LAYOUT_ENV, "0")


def node(op: str, inputs: list[str], output: str, **attrs: object) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output], **attrs)


def scalar(value: float) -> np.ndarray:
    return np.array(value, dtype=np.float32)


def kernel_counts(model: onnx.ModelProto, target: str = "llvm") -> tuple[int, int]:
    """Kernels launched per run without and with graph fusion."""
    spec, tvm_target = resolve_target(target)
    counts = []
    for disabled in (True, False):
        mod, _ = import_model(model, None)
        with tvm_target, graph_fusion_disabled() if disabled else contextlib.nullcontext():
            fused = tvm.transform.Sequential(fusion_passes(spec, tvm_target))(mod)
        counts.append(count_kernel_launches(fused))
    return counts[0], counts[1]


def fused_ops(model: onnx.ModelProto, target: str = "llvm") -> str:
    """The Relax graph after the graph-fusion passes, as text."""
    _, tvm_target = resolve_target(target)
    mod, _ = import_model(model, None)
    with tvm_target:
        mod = tvm.transform.Sequential([*canonicalize_passes(), *graph_fusion_passes()])(mod)
    return mod["main"].script(show_meta=False)


def check(model: onnx.ModelProto, inputs: dict[str, np.ndarray], target: str = "llvm") -> None:
    compiled = gimlet_tvm.build(model, target)
    assert_matches(compiled(*inputs.values()), onnxruntime_outputs(model, inputs))


# ---- LayerNorm / RMSNorm ----


def layer_norm_model(hidden: int, eps: float, affine: bool, axis: int = -1) -> onnx.ModelProto:
    nodes = [
        node("ReduceMean", ["x"], "mean", axes=[axis], keepdims=1),
        node("Sub", ["x", "mean"], "c"),
        node("Pow", ["c", "two"], "sq"),
        node("ReduceMean", ["sq"], "var", axes=[axis], keepdims=1),
        node("Add", ["var", "eps"], "var_eps"),
        node("Sqrt", ["var_eps"], "std"),
        node("Div", ["c", "std"], "y" if not affine else "n"),
    ]
    init = {"two": scalar(2.0), "eps": scalar(eps)}
    if affine:
        nodes += [node("Mul", ["gamma", "n"], "scaled"), node("Add", ["scaled", "beta"], "y")]
        init |= {"gamma": rand(hidden, seed=1), "beta": rand(1, 1, hidden, seed=2)}
    shape = ["batch", 5, hidden]
    return onnx_model(nodes, [("x", shape)], ("y", shape), init)


@pytest.mark.parametrize("target", ["llvm", "vulkan"])
def test_layer_norm_chain_is_one_kernel(target: str) -> None:
    model = layer_norm_model(48, 1e-3, affine=True)
    assert "R.nn.layer_norm" in fused_ops(model, target)
    before, after = kernel_counts(model, target)
    assert after == 1 < before
    check(model, {"x": rand(3, 5, 48)}, target)


def test_layer_norm_without_affine() -> None:
    model = layer_norm_model(32, 1e-5, affine=False)
    assert "R.nn.layer_norm" in fused_ops(model)
    check(model, {"x": rand(2, 5, 32)})


def test_norm_over_other_axis_stays_unfused() -> None:
    model = layer_norm_model(32, 1e-5, affine=True, axis=1)
    assert "layer_norm" not in fused_ops(model)
    check(model, {"x": rand(2, 5, 32)})


def test_rms_norm_chain_is_one_kernel() -> None:
    nodes = [
        node("Mul", ["x", "x"], "sq"),
        node("ReduceMean", ["sq"], "ms", axes=[-1], keepdims=1),
        node("Add", ["eps", "ms"], "ms_eps"),
        node("Sqrt", ["ms_eps"], "rms"),
        node("Div", ["x", "rms"], "n"),
        node("Mul", ["n", "gamma"], "y"),
    ]
    init = {"eps": scalar(1e-6), "gamma": rand(64, seed=3)}
    model = onnx_model(nodes, [("x", [4, 64])], ("y", [4, 64]), init)
    assert "R.nn.rms_norm" in fused_ops(model)
    assert kernel_counts(model) == (kernel_counts(model)[0], 1)
    check(model, {"x": rand(4, 64)})


# ---- GELU ----


def test_gelu_erf_chain() -> None:
    nodes = [
        node("Mul", ["x", "inv_sqrt2"], "u"),
        node("Erf", ["u"], "e"),
        node("Add", ["one", "e"], "p"),
        node("Mul", ["half", "x"], "hx"),
        node("Mul", ["hx", "p"], "y"),
    ]
    init = {"inv_sqrt2": scalar(1 / math.sqrt(2)), "one": scalar(1.0), "half": scalar(0.5)}
    model = onnx_model(nodes, [("x", ["n", 40])], ("y", ["n", 40]), init)
    assert "R.nn.gelu(" in fused_ops(model)
    check(model, {"x": rand(6, 40) * 3})


def test_gelu_tanh_chain() -> None:
    nodes = [
        node("Pow", ["x", "three"], "x3"),
        node("Mul", ["x3", "c"], "cx3"),
        node("Add", ["x", "cx3"], "s"),
        node("Mul", ["s", "k"], "u"),
        node("Tanh", ["u"], "t"),
        node("Add", ["t", "one"], "p"),
        node("Mul", ["x", "p"], "xp"),
        node("Div", ["xp", "two"], "y"),
    ]
    init = {"three": scalar(3.0), "c": scalar(0.044715), "k": scalar(math.sqrt(2 / math.pi)),
            "one": scalar(1.0), "two": scalar(2.0)}
    model = onnx_model(nodes, [("x", [2, 3, 16])], ("y", [2, 3, 16]), init)
    assert "R.nn.gelu_tanh" in fused_ops(model)
    check(model, {"x": rand(2, 3, 16) * 3})


def test_gelu_with_wrong_constant_stays_unfused() -> None:
    nodes = [
        node("Div", ["x", "sqrt2"], "u"),
        node("Erf", ["u"], "e"),
        node("Add", ["e", "one"], "p"),
        node("Mul", ["x", "p"], "xp"),
        node("Mul", ["xp", "almost_half"], "y"),
    ]
    init = {"sqrt2": scalar(math.sqrt(2)), "one": scalar(1.0), "almost_half": scalar(0.55)}
    model = onnx_model(nodes, [("x", [8, 16])], ("y", [8, 16]), init)
    assert "gelu" not in fused_ops(model)
    check(model, {"x": rand(8, 16)})


# ---- SiLU ----


@pytest.mark.parametrize("gate_first", [False, True])
@pytest.mark.parametrize("target", ["llvm", "vulkan"])
def test_silu_chain(gate_first: bool, target: str) -> None:
    """x * sigmoid(x), as exporters write SiLU before opset 22, becomes `R.nn.silu` (in
    either operand order) and still matches onnxruntime, also past the sigmoid's tails."""
    operands = ["s", "x"] if gate_first else ["x", "s"]
    nodes = [node("Sigmoid", ["x"], "s"), node("Mul", operands, "y")]
    model = onnx_model(nodes, [("x", ["n", 3, 40])], ("y", ["n", 3, 40]), {})
    script = fused_ops(model, target)
    assert "R.nn.silu(" in script and "R.sigmoid(" not in script
    x = rand(2, 3, 40) * 40  # out to +-100: exp(-x) overflows a naive sigmoid
    check(model, {"x": x}, target)


def test_swish_with_a_slope_stays_unfused() -> None:
    nodes = [node("Mul", ["x", "beta"], "bx"), node("Sigmoid", ["bx"], "s"), node("Mul", ["x", "s"], "y")]
    model = onnx_model(nodes, [("x", [4, 24])], ("y", [4, 24]), {"beta": scalar(1.702)})
    assert "silu" not in fused_ops(model)
    check(model, {"x": rand(4, 24) * 5})


def test_sigmoid_read_elsewhere_stays() -> None:
    """The SiLU is fused; the sigmoid, which the output reads too, stays."""
    nodes = [node("Sigmoid", ["x"], "s"), node("Mul", ["x", "s"], "m"), node("Add", ["m", "s"], "y")]
    model = onnx_model(nodes, [("x", [4, 24])], ("y", [4, 24]), {})
    script = fused_ops(model)
    assert "R.nn.silu(" in script and "R.sigmoid(" in script
    check(model, {"x": rand(4, 24) * 5})


# ---- attention ----


def attention_model(heads: int, mask: bool, scale: bool, softmax_axis: int = -1) -> onnx.ModelProto:
    """BERT-style heads: q, k, v [batch, seq, hidden] to [batch, heads, seq, depth]."""
    seq, depth = 10, 8
    hidden = heads * depth
    split = np.array([-1, seq, heads, depth], dtype=np.int64)
    nodes = [
        node("Reshape", ["q", "split"], "q4"),
        node("Transpose", ["q4"], "qh", perm=[0, 2, 1, 3]),
        node("Reshape", ["k", "split"], "k4"),
        node("Transpose", ["k4"], "kt", perm=[0, 2, 3, 1]),
        node("Reshape", ["v", "split"], "v4"),
        node("Transpose", ["v4"], "vh", perm=[0, 2, 1, 3]),
        node("MatMul", ["qh", "kt"], "s"),
    ]
    scores = "s"
    if scale:
        nodes.append(node("Div", [scores, "sqrt_d"], "ss"))
        scores = "ss"
    if mask:
        nodes.append(node("Add", ["mask", scores], "sm"))
        scores = "sm"
    nodes += [
        node("Softmax", [scores], "p", axis=softmax_axis),
        node("MatMul", ["p", "vh"], "o"),
        node("Transpose", ["o"], "ot", perm=[0, 2, 1, 3]),
        node("Reshape", ["ot", "merge"], "y"),
    ]
    init = {"split": split, "merge": np.array([-1, seq, hidden], dtype=np.int64),
            "sqrt_d": scalar(math.sqrt(depth))}
    inputs = [(name, ["batch", seq, hidden]) for name in "qkv"]
    if mask:
        inputs.append(("mask", ["batch", 1, 1, seq]))
    return onnx_model(nodes, inputs, ("y", ["batch", seq, hidden]), init)


def attention_inputs(model: onnx.ModelProto, batch: int) -> dict[str, np.ndarray]:
    inputs = {}
    for i, value_info in enumerate(model.graph.input):
        dims = [batch if d.dim_param else d.dim_value for d in value_info.type.tensor_type.shape.dim]
        inputs[value_info.name] = rand(*dims, seed=i)
    if "mask" in inputs:
        inputs["mask"] = np.where(inputs["mask"] > 0.5, -10000.0, 0.0).astype(np.float32)
    return inputs


@pytest.mark.parametrize("heads, mask, scale", [(3, True, True), (1, False, False), (4, True, False)])
def test_attention_is_one_library_kernel(heads: int, mask: bool, scale: bool) -> None:
    model = attention_model(heads, mask, scale)
    assert "R.nn.attention" in fused_ops(model)
    before, after = kernel_counts(model)
    assert after < before
    check(model, attention_inputs(model, batch=2))


def test_attention_on_vulkan_stays_correct() -> None:
    """No fused attention kernel on GPU targets yet: the chain is left as it is."""
    model = attention_model(2, mask=True, scale=True)
    assert "R.nn.attention" not in fused_ops(model, "vulkan")
    check(model, attention_inputs(model, batch=2), "vulkan")


def test_softmax_over_other_axis_is_not_attention() -> None:
    model = attention_model(2, mask=True, scale=True, softmax_axis=2)
    assert "R.nn.attention" not in fused_ops(model)
    check(model, attention_inputs(model, batch=1))


# ---- epilogues ----


def test_conv_bias_residual_relu_is_one_library_call() -> None:
    nodes = [
        node("Conv", ["x", "w", "b"], "c", pads=[1, 1, 1, 1]),
        node("Add", ["c", "x"], "r"),
        node("Relu", ["r"], "y"),
    ]
    init = {"w": rand(8, 8, 3, 3, seed=1) * 0.2, "b": rand(8, seed=2)}
    model = onnx_model(nodes, [("x", ["n", 8, 12, 12])], ("y", ["n", 8, 12, 12]), init)
    assert kernel_counts(model) == (2, 1)
    check(model, {"x": rand(2, 8, 12, 12)})


def test_matmul_bias_gelu_is_one_library_call() -> None:
    nodes = [
        node("MatMul", ["x", "w"], "m"),
        node("Add", ["bias", "m"], "h"),
        node("Div", ["h", "sqrt2"], "u"),
        node("Erf", ["u"], "e"),
        node("Add", ["e", "one"], "p"),
        node("Mul", ["h", "p"], "hp"),
        node("Mul", ["hp", "half"], "y"),
    ]
    init = {"w": rand(24, 40, seed=1), "bias": rand(40, seed=2), "sqrt2": scalar(math.sqrt(2)),
            "one": scalar(1.0), "half": scalar(0.5)}
    model = onnx_model(nodes, [("x", ["n", 7, 24])], ("y", ["n", 7, 40]), init)
    assert kernel_counts(model) == (2, 1)
    check(model, {"x": rand(3, 7, 24)})


@pytest.mark.parametrize("op", ["Conv", "MatMul"])
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_silu_and_sigmoid_are_epilogues(op: str, activation: str) -> None:
    """A conv's or matmul's SiLU (EfficientNet's activation, a gated MLP's gate) or sigmoid
    runs in the library call's epilogue: one kernel instead of two."""
    if op == "Conv":
        first = node("Conv", ["x", "w", "b"], "c", pads=[1, 1, 1, 1])
        init = {"w": rand(16, 8, 3, 3, seed=1), "b": rand(16, seed=2)}
        shapes = [("x", ["n", 8, 12, 12])], ("y", ["n", 16, 12, 12])
        x = rand(2, 8, 12, 12) * 3
    else:
        first = node("MatMul", ["x", "w"], "c")
        init = {"w": rand(24, 40, seed=1)}
        shapes = [("x", ["n", 7, 24])], ("y", ["n", 7, 40])
        x = rand(3, 7, 24) * 3
    tail = [node("Sigmoid", ["c"], "s")]
    tail += [node("Mul", ["c", "s"], "y")] if activation == "silu" else [node("Identity", ["s"], "y")]
    model = onnx_model([first, *tail], *shapes, init)
    assert kernel_counts(model) == (2, 1)
    check(model, {"x": x})


@pytest.mark.parametrize("op", ["Conv", "MatMul"])
@pytest.mark.parametrize("form, fused", [
    ("HardSwish", True),  # clip(x + 3, 0, 6) / 6 * x, as the importer writes it
    ("HardSigmoid 1/6", True),  # clip(x / 6 + 1/2, 0, 1) * x: the same function
    ("HardSigmoid 0.2", False),  # ONNX's default alpha: another function, stays a kernel of its own
])
def test_hard_swish_is_an_epilogue(op: str, form: str, fused: bool) -> None:
    """MobileNetV3's hard-swish after a conv or matmul (with a bias) runs in the library call's
    epilogue, whichever way the model writes it; a hard-sigmoid of other slopes times x does
    not, and both compute what onnxruntime does."""
    if op == "Conv":
        first = [node("Conv", ["x", "w", "b"], "c", pads=[1, 1, 1, 1])]
        init = {"w": rand(16, 8, 3, 3, seed=1), "b": rand(16, seed=2)}
        shapes = [("x", ["n", 8, 12, 12])], ("y", ["n", 16, 12, 12])
        x = rand(2, 8, 12, 12) * 3
    else:
        first = [node("MatMul", ["x", "w"], "m"), node("Add", ["m", "b"], "c")]
        init = {"w": rand(24, 40, seed=1), "b": rand(40, seed=2)}
        shapes = [("x", ["n", 7, 24])], ("y", ["n", 7, 40])
        x = rand(3, 7, 24) * 3
    if form == "HardSwish":
        tail = [node("HardSwish", ["c"], "y")]
    else:
        alpha = 1 / 6 if form == "HardSigmoid 1/6" else 0.2
        tail = [node("HardSigmoid", ["c"], "g", alpha=alpha, beta=0.5), node("Mul", ["g", "c"], "y")]
    model = onnx_model([*first, *tail], *shapes, init)
    assert kernel_counts(model) == (2, 1 if fused else 2)
    check(model, {"x": x})


@pytest.mark.parametrize("channels, bounds, launches", [
    (8, (0.0, 6.0), 1),  # ReLU6 after the direct kernel (3x3, two channel blocks of 8)
    (3, (-1.0, 0.5), 1),  # after im2col + OpenBLAS (3 input channels)
    (8, (0.25, None), 1),  # a lower bound only
    (8, (None, -0.5), 1),  # an upper bound only
    (8, (1.0, -1.0), 1),  # lo > hi: every output is hi (ONNX: min(max(x, lo), hi))
    (8, (float("nan"), 2.0), 1),  # a NaN bound is no bound
])
def test_conv_bias_clip_is_one_library_call(channels: int, bounds: tuple, launches: int) -> None:
    lo, hi = bounds
    clip_inputs = ["c", "lo" if lo is not None else "", "hi" if hi is not None else ""]
    nodes = [node("Conv", ["x", "w", "b"], "c", pads=[1, 1, 1, 1]), node("Clip", clip_inputs, "y")]
    init = {"w": rand(16, channels, 3, 3, seed=1), "b": rand(16, seed=2)}
    init |= {name: scalar(v) for name, v in (("lo", lo), ("hi", hi)) if v is not None}
    model = onnx_model(nodes, [("x", ["n", channels, 12, 12])], ("y", ["n", 16, 12, 12]), init)
    assert kernel_counts(model)[1] == launches
    check(model, {"x": rand(2, channels, 12, 12)})


def test_clip_bounds_are_vm_constants() -> None:
    """A fused clip's bounds reach the library as a constant: the VM computes nothing before
    the conv call (float scalars had taken a call each, twice a conv in MobileNetV2)."""
    nodes = [node("Conv", ["x", "w", "b"], "c", pads=[1, 1, 1, 1]), node("Clip", ["c", "lo", "hi"], "y")]
    init = {"w": rand(16, 16, 3, 3, seed=1), "b": rand(16, seed=2), "lo": scalar(0.0), "hi": scalar(6.0)}
    model = onnx_model(nodes, [("x", [1, 16, 12, 12])], ("y", [1, 16, 12, 12]), init)
    mod, _ = import_model(model, None)
    (spec, target), = resolve_devices("llvm")
    with target:
        text = tvm.compile(mod, target, relax_pipeline=device_pipeline([(spec, target)], None)).as_text()
    assert "gimlet.cpu.conv2d" in text and "compute_symbolic_expr" not in text
    check(model, {"x": rand(1, 16, 12, 12)})


def test_clip_attributes_and_nan_inputs() -> None:
    """Clip-6 (bounds as attributes) fused into a matmul; NaN inputs stay NaN (ONNX's
    reference and onnxruntime)."""
    nodes = [node("MatMul", ["x", "w"], "m"), node("Clip", ["m"], "y", min=-0.5, max=0.5)]
    model = onnx_model(nodes, [("x", [4, 16])], ("y", [4, 8]), {"w": rand(16, 8, seed=1)})
    model.opset_import[0].version = 6
    assert kernel_counts(model)[1] == 1
    x = rand(4, 16)
    x[1, 3] = np.nan
    check(model, {"x": x})


def test_clip_with_another_use_is_not_fused() -> None:
    nodes = [node("Conv", ["x", "w"], "c", pads=[1, 1, 1, 1]), node("Clip", ["c", "lo", "hi"], "r"),
             node("Add", ["c", "r"], "y")]
    init = {"w": rand(16, 8, 3, 3, seed=1), "lo": scalar(0.0), "hi": scalar(6.0)}
    model = onnx_model(nodes, [("x", [2, 8, 10, 10])], ("y", [2, 16, 10, 10]), init)
    check(model, {"x": rand(2, 8, 10, 10)})


def test_epilogue_with_another_use_is_not_fused() -> None:
    nodes = [node("MatMul", ["x", "w"], "m"), node("Relu", ["m"], "r"), node("Add", ["m", "r"], "y")]
    model = onnx_model(nodes, [("x", [5, 16])], ("y", [5, 16]), {"w": rand(16, 16, seed=1)})
    check(model, {"x": rand(5, 16)})


@pytest.mark.parametrize("kind, dispatched", [(None, True), ("llvm", True), ("cuda", False)])
def test_library_dispatch_only_on_host_devices(kind: str | None, dispatched: bool) -> None:
    vdevice = None if kind is None else VDevice(tvm.target.Target(kind), 0, "global")
    ty = relax.TensorType((4, 4), "float32", vdevice=vdevice)
    a, b = relax.Var("a", ty), relax.Var("b", ty)
    builder = relax.BlockBuilder()
    with builder.function("main", [a, b]):
        with builder.dataflow():
            out = builder.emit_output(relax.op.matmul(a, b))
        builder.emit_func_output(out)
    script = DispatchCPULibrary()(builder.get()).script()
    assert (MATMUL_FUNC in script) == dispatched
