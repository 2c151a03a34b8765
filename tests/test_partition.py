"""Cross-device placement (vulkan on lavapipe + llvm) and the multi-device VM: real builds,
real runs on both devices in one VM, compared with onnxruntime; the placement checked
against brute force (exact for two devices, a local optimum for three).
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gimlet_tvm
from gimlet_tvm.compiler import canonicalize_passes, resolve_devices
from gimlet_tvm.frontend import import_model
from gimlet_tvm.relax_passes.op_graph import OpGraph
from gimlet_tvm.relax_passes.placement import Device, Pins, _report, op_costs, place
from gimlet_tvm.schedules.tuning.records import RecordsDB
from gimlet_tvm.targets import lookup
from gimlet_tvm.targets.spec import PerfFacts

from .conftest import assert_matches, onnxruntime_outputs

TARGETS = ["vulkan", "llvm"]
# A device described as much faster than the host at arithmetic, over a fast link.
FAST_DEVICE = {"peak_gflops": 1e6, "memory_gbps": 1e4, "launch_us": 5, "link_gbps": 1e3, "copy_us": 1}
# The same device behind a link so slow that any copy costs more than the work.
SLOW_LINK = {**FAST_DEVICE, "link_gbps": 1e-3}


def mlp_block(hidden: int = 64, rng=np.random.default_rng(0)) -> onnx.ModelProto:
    """x -> MatMul -> Add -> Relu -> MatMul -> Softmax: a heavy op between cheap ones."""
    weights = [
        numpy_helper.from_array(rng.standard_normal((hidden, hidden)).astype(np.float32) * 0.1, "w1"),
        numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((hidden, hidden)).astype(np.float32) * 0.1, "w2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="first_matmul"),
        helper.make_node("Add", ["h", "b1"], ["hb"], name="bias"),
        helper.make_node("Relu", ["hb"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="second_matmul"),
        helper.make_node("Softmax", ["y"], ["out"], name="softmax", axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "mlp_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", hidden])],
        initializer=weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def float64_section() -> onnx.ModelProto:
    """A float32 model with a float64 island (Cast, Mul, Cast back): vulkan has no float64."""
    nodes = [
        helper.make_node("Cast", ["x"], ["x64"], name="to_double", to=TensorProto.DOUBLE),
        helper.make_node("Mul", ["x64", "x64"], ["sq"], name="square"),
        helper.make_node("Cast", ["sq"], ["y"], name="to_float", to=TensorProto.FLOAT),
        helper.make_node("Relu", ["y"], ["out"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes, "float64_island",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4, 8])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def run_both(model: onnx.ModelProto, compiled: gimlet_tvm.CompiledModel, batch: int = 3) -> None:
    shape = [batch if isinstance(d, str) else d for d in compiled.inputs[0].shape]
    inputs = {"x": np.random.default_rng(batch).standard_normal(shape).astype(np.float32)}
    assert_matches(list(compiled.run(inputs).values()), onnxruntime_outputs(model, inputs))


def test_pinned_ops_run_on_vulkan_and_the_rest_on_llvm_in_one_vm(tmp_path):
    model = mlp_block()
    compiled = gimlet_tvm.build(model, TARGETS, pins={"MatMul": "vulkan"})
    placement = compiled.placement()
    assert placement.device_of("first_matmul") == "vulkan"
    assert placement.device_of("second_matmul") == "vulkan"
    assert placement.device_of("relu") == "llvm"  # lavapipe's launch cost loses on cheap ops
    assert len(placement.copies) >= 3 and placement.copy_bytes > 0
    assert [t["name"] for t in compiled.targets] == ["llvm", "vulkan"]
    assert compiled.targets[1]["device_code"]["checked_with"] == "spirv-val"
    run_both(model, compiled, batch=1)
    run_both(model, compiled, batch=5)
    profile = compiled.profile()
    devices_used = {device for _, device, _, _ in profile.calls}
    assert {"llvm", "vulkan"} <= devices_used
    assert any(name.startswith("vm.builtin.to_device") for name, *_ in profile.calls)
    assert set(profile.planned_memory) == {"llvm", "vulkan"}
    # The artifact keeps both devices' code and the placement.
    compiled.export(tmp_path / "placed.so")
    loaded = gimlet_tvm.load(tmp_path / "placed.so")
    assert loaded.placement().device_of("first_matmul") == "vulkan"
    run_both(model, loaded, batch=2)


def test_split_outputs_and_concat_inputs_cross_devices():
    nodes = [
        helper.make_node("Split", ["x"], ["a", "b"], name="halves", axis=1, num_outputs=2),
        helper.make_node("Relu", ["a"], ["ra"], name="relu_a"),
        helper.make_node("Sigmoid", ["b"], ["sb"], name="sigmoid_b"),
        helper.make_node("Concat", ["ra", "sb", "a"], ["out"], name="join", axis=1),
    ]
    graph = helper.make_graph(
        nodes, "split_concat",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4, 12])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    compiled = gimlet_tvm.build(model, TARGETS, pins={"halves": "vulkan", "relu_a": "vulkan",
                                                      "sigmoid_b": "llvm", "Concat": "llvm"})
    placement = compiled.placement()
    assert placement.device_of("relu_a") == "vulkan" and placement.device_of("sigmoid_b") == "llvm"
    run_both(model, compiled)


def test_an_op_vulkan_cannot_run_falls_back_to_llvm():
    model = float64_section()
    compiled = gimlet_tvm.build(model, TARGETS, pins={"square": "vulkan", "Relu": "vulkan"})
    placement = compiled.placement()
    square = next(op for op in placement.ops if op["name"] == "square")
    assert square["device"] == "llvm"
    assert "float64" in square["reason"] and "falls back" in square["reason"]
    relu = next(op for op in placement.ops if op["op"] == "nn.relu")  # the output: named gv
    assert relu["device"] == "vulkan" and relu["reason"] == "pinned to vulkan"
    run_both(model, compiled)


def test_transfer_cost_keeps_the_model_on_one_device():
    model = mlp_block(hidden=256)
    compiled = gimlet_tvm.build(model, TARGETS, device_facts={"vulkan": SLOW_LINK})
    placement = compiled.placement()
    assert placement.ops_per_device() == {"llvm": len(placement.ops)}
    assert placement.copies == []
    assert [t["name"] for t in compiled.targets] == ["llvm"]  # built as a one-device model
    run_both(model, compiled)


def test_a_much_faster_device_takes_the_heavy_op():
    model = mlp_block(hidden=256)
    facts = {"vulkan": FAST_DEVICE, "llvm": {"peak_gflops": 1.0}}
    compiled = gimlet_tvm.build(model, TARGETS, device_facts=facts)
    placement = compiled.placement()
    assert placement.device_of("first_matmul") == "vulkan"
    assert placement.device_of("second_matmul") == "vulkan"
    run_both(model, compiled)


def test_measured_costs_time_every_op_on_both_devices():
    model = mlp_block()
    compiled = gimlet_tvm.build(model, TARGETS, placement_costs="measured")
    ops = compiled.placement().ops
    assert all(set(op["sources"].values()) == {"measured"} for op in ops)
    assert all(op["costs_us"]["llvm"] > 0 and op["costs_us"]["vulkan"] > 0 for op in ops)
    # Never worse, by its own measured costs, than keeping everything on the host (no copies).
    # The report rounds each op's time to 1 ns and the total to 1 ns: allow that rounding.
    all_on_host_ms = sum(op["costs_us"]["llvm"] for op in ops) / 1e3
    assert compiled.placement().modelled_ms <= all_on_host_ms + (len(ops) + 1) * 1e-6
    run_both(model, compiled)


def random_devices(targets: list[str], rng: np.random.Generator) -> list[Device]:
    """The build's devices for `targets`, each given random roofline and link facts."""
    devices = []
    for spec, _ in resolve_devices(targets):
        facts = PerfFacts(peak_gflops=100 * rng.uniform(0.01, 100), memory_gbps=20 * rng.uniform(0.1, 10),
                          launch_us=float(rng.uniform(0, 50)),
                          link_gbps=None if spec.name == "llvm" else float(rng.uniform(0.01, 50)),
                          copy_us=float(rng.uniform(0, 30)))
        devices.append(Device(spec, facts))
    return devices


def random_problem(targets: list[str], seed: int):
    """An MLP block's op graph and random device descriptions for `targets`."""
    import tvm

    rng = np.random.default_rng(seed)
    mod, _ = import_model(mlp_block(hidden=int(rng.integers(8, 512))))
    graph = OpGraph.of(tvm.transform.Sequential(canonicalize_passes())(mod)["main"])
    return graph, random_devices(targets, rng)


def modelled(graph, devices, best, labels) -> float:
    """Modelled latency of `labels` for the free ops of `best` (host-only ops stay on the host)."""
    costs, sources = op_costs(graph, devices)
    reasons = [op.reason for op in best.ops]
    full = [op.device for op in best.ops]
    for i, label in labels.items():
        full[i] = label
    return _report(graph, devices, full, reasons, costs, sources).modelled_seconds


@pytest.mark.parametrize("seed", range(6))
def test_two_device_placement_matches_brute_force(seed):
    """With two devices, the placement has the least modelled latency of all 2^n labellings."""
    graph, devices = random_problem(TARGETS, seed)
    best = place(graph, devices, Pins())
    free = [i for i, node in enumerate(graph.nodes) if not node.host_only]
    brute = min(modelled(graph, devices, best, dict(zip(free, labels)))
                for labels in itertools.product([0, 1], repeat=len(free)))
    assert best.modelled_seconds == pytest.approx(brute, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_three_device_placement_is_a_local_optimum(seed):
    """With three devices, no expansion move (any set of ops moving to one device) lowers the
    modelled latency, and the placement is no worse than any one-device placement."""
    graph, devices = random_problem(["vulkan", "cuda", "llvm"], seed)
    best = place(graph, devices, Pins())
    current = {i: op.device for i, op in enumerate(best.ops) if not op.node.host_only}
    for alpha in range(len(devices)):
        assert best.modelled_seconds <= modelled(graph, devices, best, dict.fromkeys(current, alpha)) * (1 + 1e-9)
        movable = [i for i, label in current.items() if label != alpha]
        for moves in itertools.product([False, True], repeat=len(movable)):
            labels = {**current, **{i: alpha for i, moved in zip(movable, moves) if moved}}
            assert best.modelled_seconds <= modelled(graph, devices, best, labels) * (1 + 1e-9)


def test_three_targets_build_into_one_artifact(tmp_path):
    """Ops pinned to vulkan and cuda, the rest on llvm: one executable with code for all three
    (the CUDA kernels are compiled by nvcc; running them needs a GPU)."""
    pins = {"first_matmul": "vulkan", "second_matmul": "cuda"}
    compiled = gimlet_tvm.build(mlp_block(), ["vulkan", "cuda", "llvm"], pins=pins)
    placement = compiled.placement()
    assert placement.device_of("first_matmul") == "vulkan"
    assert placement.device_of("second_matmul") == "cuda"
    assert placement.ops_per_device()["llvm"] == 3
    assert [t["name"] for t in compiled.targets] == ["llvm", "vulkan", "cuda"]
    compiled.export(tmp_path / "three.tar")
    assert (tmp_path / "three.tar").stat().st_size > 0


@pytest.mark.slow
def test_tuning_records_give_op_times(tmp_path):
    """Ops whose kernels have tuning records for a device's target take their time from the
    records (here the softmax on llvm); the others keep the roofline."""
    model, shapes = mlp_block(), {"x": [4, 64]}
    records = str(tmp_path / "records")
    gimlet_tvm.tune(model, "llvm", records, trials=4, input_shapes=shapes, trials_per_round=4,
                    population_size=16, seed=0)
    compiled = gimlet_tvm.build(model, TARGETS, input_shapes=shapes, records=records)
    ops = {op["op"]: op for op in compiled.placement().ops}
    softmax = ops["nn.softmax"]
    assert softmax["sources"] == {"llvm": "tuning records", "vulkan": "roofline"}
    recorded_us = sum(r.seconds for r in RecordsDB(records).best()) * 1e6
    assert softmax["costs_us"]["llvm"] == pytest.approx(recorded_us, abs=1e-3)
    assert ops["matmul"]["sources"]["llvm"] == "roofline"  # a library call: no TIR kernel to tune
    run_both(model, compiled, batch=4)


def test_placement_reports_and_draws(tmp_path):
    compiled = gimlet_tvm.build(mlp_block(), TARGETS, pins={"second_matmul": "vulkan"})
    report = compiled.placement()
    text = str(report)
    assert "second_matmul" in text and "pinned to vulkan" in text and "copies" in text
    report.write_graph(tmp_path / "placement.dot")
    dot = (tmp_path / "placement.dot").read_text()
    assert dot.startswith("digraph") and 'label="copy"' in dot
    report.write_graph(tmp_path / "placement.png")
    assert (tmp_path / "placement.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_placement_errors_name_the_problem():
    with pytest.raises(gimlet_tvm.GimletError, match="pinned to 'cuda'"):
        gimlet_tvm.build(mlp_block(), TARGETS, pins={"Relu": "cuda"})
    with pytest.raises(gimlet_tvm.GimletError, match="given twice"):
        gimlet_tvm.build(mlp_block(), ["llvm", "cpu"])
    with pytest.raises(gimlet_tvm.GimletError, match="device_facts for targets not in the build"):
        gimlet_tvm.build(mlp_block(), TARGETS, device_facts={"rocm": {"peak_gflops": 1}})
    with pytest.raises(gimlet_tvm.GimletError, match="placement needs several targets"):
        gimlet_tvm.build(mlp_block(), "llvm").placement()


def test_cli_compiles_across_devices_and_runs_the_artifact(cli, tmp_path):
    model = mlp_block()
    onnx.save(model, str(tmp_path / "block.onnx"))
    code, out, err = cli("compile", "block.onnx", "-t", "vulkan,llvm", "--pin", "MatMul=vulkan",
                         "-o", "placed.so", "--placement-graph", "placement.svg")
    assert code == 0, err
    assert "for llvm+vulkan" in out and "pinned to vulkan" in out and "copies" in out
    assert (tmp_path / "placement.svg").read_text().lstrip().startswith("<?xml")
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    code, _, err = cli("run", "placed.so", "--inputs", "in.npz", "--outputs", "out.npz")
    assert code == 0, err
    assert_matches([np.load(tmp_path / "out.npz")["out"]], onnxruntime_outputs(model, {"x": x}))
    code, _, err = cli("compile", "block.onnx", "-t", "vulkan,llvm", "--pin", "MatMul", "-o", "x.so")
    assert code == 2 and "--pin expects OP=TARGET" in err
