"""The model suite compiled for LLVM CPU matches onnxruntime, at several batch sizes."""

from __future__ import annotations

import numpy as np
import pytest

import gimlet_tvm
from gimlet_tvm.models import SUITE

from .conftest import (
    TEST_MODELS,
    assert_matches,
    compiled_suite_model,
    onnxruntime_outputs,
    suite_model,
)


@pytest.mark.parametrize("name", TEST_MODELS)
@pytest.mark.parametrize("batch", [1, 8])
def test_matches_onnxruntime_with_symbolic_batch(on_device, name: str, batch: int) -> None:
    model = compiled_suite_model(name)
    assert model.inputs[0].shape[0] == "batch"
    inputs = SUITE[name].example_inputs(batch=batch, seed=batch)
    ours = on_device(model)(*inputs.values())
    assert_matches(ours, onnxruntime_outputs(suite_model(name), inputs))
    assert ours == [] or ours[0].shape[0] == batch


def test_run_by_name_equals_positional_call() -> None:
    model = compiled_suite_model("transformer_encoder")
    inputs = SUITE["transformer_encoder"].example_inputs(batch=2)
    by_name = model.run(inputs)
    assert list(by_name) == model.output_names
    for got, want in zip(by_name.values(), model(*inputs.values())):
        np.testing.assert_array_equal(got, want)


def test_input_shapes_fixes_batch() -> None:
    proto = suite_model("mlp")
    model = gimlet_tvm.build(proto, "llvm", input_shapes={"x": [4, 1024]})
    assert model.inputs[0].shape == (4, 1024)
    assert model.outputs[0].shape == (4, 1024)
    inputs = SUITE["mlp"].example_inputs(batch=4)
    assert_matches(model(*inputs.values()), onnxruntime_outputs(proto, inputs))
    with pytest.raises(gimlet_tvm.InputError, match="expected 4 at axis 0"):
        model(*SUITE["mlp"].example_inputs(batch=2).values())


@pytest.mark.parametrize("source", ["path", "bytes", "proto"])
def test_model_given_as_path_bytes_or_proto(tmp_path, source: str) -> None:
    proto = suite_model("mobilenet_cnn")
    path = tmp_path / "m.onnx"
    path.write_bytes(proto.SerializeToString())
    model = {"path": str(path), "bytes": proto.SerializeToString(), "proto": proto}[source]
    compiled = gimlet_tvm.build(model, "llvm")
    inputs = SUITE["mobilenet_cnn"].example_inputs(batch=1)
    assert_matches(compiled(*inputs.values()), onnxruntime_outputs(proto, inputs))


def test_export_and_load_round_trip(tmp_path) -> None:
    model = compiled_suite_model("resnet_cnn")
    path = tmp_path / "resnet.so"
    model.export(path)
    assert [p.name for p in tmp_path.iterdir()] == ["resnet.so"]
    loaded = gimlet_tvm.load(path)
    assert loaded.io == model.io
    assert loaded.metadata["targets"] == model.targets
    assert loaded.metadata["tvm_version"] == model.metadata["tvm_version"]
    inputs = SUITE["resnet_cnn"].example_inputs(batch=3)
    assert_matches(loaded(*inputs.values()), onnxruntime_outputs(suite_model("resnet_cnn"), inputs))


def test_benchmark_reports_median_and_spread() -> None:
    result = compiled_suite_model("mlp").benchmark(repeat=5, warmup=1)
    assert result.runs == 5
    assert 0 < result.min_ms <= result.p10_ms <= result.median_ms <= result.p90_ms <= result.max_ms


def test_host_target_detects_cpu() -> None:
    model = compiled_suite_model("mlp")
    target = model.targets[0]["target"]
    assert target["kind"] == "llvm"
    assert target["mcpu"] not in ("", "generic")
    assert target["num-cores"] >= 1


def test_vector_code_uses_the_hosts_widest_registers(tmp_path) -> None:
    """On an AVX-512 host the default build's kernels use 512-bit (zmm) registers."""
    import subprocess

    from gimlet_tvm.targets.llvm import host_facts

    facts = host_facts()
    register = {512: "zmm", 256: "ymm", 128: "xmm"}[facts["vector_bits"]]
    path = tmp_path / "transformer.so"
    compiled_suite_model("transformer_encoder").export(path)
    assembly = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)],
                              capture_output=True, text=True, check=True).stdout
    vector_ops = [line for line in assembly.splitlines() if f"%{register}" in line]
    assert len(vector_ops) > 100, f"{len(vector_ops)} instructions use {register} ({facts})"
