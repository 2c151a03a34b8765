"""The `gimlet-tvm` console script, through its real entry point."""

from __future__ import annotations

import numpy as np
import pytest

import gimlet_tvm
from gimlet_tvm.models import SUITE

from .conftest import onnxruntime_outputs, suite_model
from .test_errors import unsupported_ops_model


@pytest.fixture
def mlp_file(tmp_path):
    path = tmp_path / "mlp.onnx"
    path.write_bytes(suite_model("mlp").SerializeToString())
    return path


def test_version(cli) -> None:
    code, out, _ = cli("--version")
    assert code == 0
    assert out.startswith(f"gimlet-tvm {gimlet_tvm.__version__} (TVM 0.27.0")


def test_targets_lists_llvm_with_host_facts(cli) -> None:
    code, out, _ = cli("targets")
    assert code == 0
    llvm = next(line for line in out.splitlines() if line.startswith("llvm "))
    assert "yes" in llvm and "mcpu=" in llvm and "vector_bits=" in llvm


def test_compile_run_round_trip(cli, tmp_path, mlp_file) -> None:
    code, out, err = cli("compile", str(mlp_file), "-t", "llvm", "-o", "mlp.so")
    assert code == 0, err
    assert "input  x: float32[batch, 1024]" in out
    inputs = SUITE["mlp"].example_inputs(batch=3)
    np.savez(tmp_path / "in.npz", **inputs)
    code, out, err = cli("run", "mlp.so", "--inputs", "in.npz", "--outputs", "out.npz")
    assert code == 0, err
    with np.load(tmp_path / "out.npz") as outputs:
        [expected] = onnxruntime_outputs(suite_model("mlp"), inputs)
        np.testing.assert_allclose(outputs["y"], expected, rtol=1e-4, atol=1e-4)


def test_python_module_entry_point(tmp_path, mlp_file) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "gimlet_tvm", "run", str(mlp_file)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "y: float32[1, 1024]" in proc.stdout


def test_bench_compares_with_onnxruntime(cli, mlp_file) -> None:
    code, out, err = cli("--threads", "2", "bench", str(mlp_file), "--compare", "onnxruntime",
                         "--repeat", "3", "--dim", "batch=2")
    assert code == 0, err
    assert "(2 threads each)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:] if line.strip()}
    assert set(rows) >= {"gimlet-tvm", "onnxruntime"}
    assert float(rows["onnxruntime"][1]) > 0


def one_line_error(code: int, out: str, err: str) -> str:
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gimlet-tvm: error: "), err
    return lines[0]


def test_compile_missing_model(cli, tmp_path) -> None:
    line = one_line_error(*cli("compile", "missing.onnx", "-o", "out.so"))
    assert "model file not found" in line
    assert not (tmp_path / "out.so").exists()


def test_compile_non_onnx_file(cli, tmp_path) -> None:
    (tmp_path / "junk.onnx").write_bytes(b"\x00\x01garbage" * 10)
    line = one_line_error(*cli("compile", "junk.onnx", "-o", "out.so"))
    assert "not an ONNX model" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.onnx"]


def test_compile_unsupported_ops(cli, tmp_path) -> None:
    (tmp_path / "u.onnx").write_bytes(unsupported_ops_model().SerializeToString())
    line = one_line_error(*cli("compile", "u.onnx", "-o", "out.so"))
    assert "com.example::Mystery (nodes: first_mystery, second_mystery)" in line
    assert "com.example::Enigma (nodes: the_enigma)" in line
    assert not (tmp_path / "out.so").exists()


def test_compile_unknown_target(cli, mlp_file) -> None:
    line = one_line_error(*cli("compile", str(mlp_file), "-t", "tpu9000", "-o", "out.so"))
    assert "unknown target 'tpu9000'; known targets:" in line and "llvm" in line


def test_run_wrong_input_shape(cli, tmp_path, mlp_file) -> None:
    np.savez(tmp_path / "in.npz", x=np.zeros((2, 1000), np.float32))
    line = one_line_error(*cli("run", str(mlp_file), "--inputs", "in.npz", "--outputs", "o.npz"))
    assert "input 'x' has shape [2, 1000], expected 1024 at axis 1" in line
    assert not (tmp_path / "o.npz").exists()


def test_run_wrong_input_dtype_and_name(cli, tmp_path, mlp_file) -> None:
    np.savez(tmp_path / "d.npz", x=np.zeros((2, 1024), np.int32))
    assert "dtype int32, expected float32" in one_line_error(
        *cli("run", str(mlp_file), "--inputs", "d.npz"))
    np.savez(tmp_path / "n.npz", image=np.zeros((2, 1024), np.float32))
    assert "unknown input(s) ['image']" in one_line_error(
        *cli("run", str(mlp_file), "--inputs", "n.npz"))


def test_run_corrupt_artifact(cli, tmp_path, mlp_file) -> None:
    code, _, err = cli("compile", str(mlp_file), "-o", "mlp.so")
    assert code == 0, err
    data = bytearray((tmp_path / "mlp.so").read_bytes())
    data[200] ^= 0x55
    (tmp_path / "mlp.so").write_bytes(bytes(data))
    assert "checksum mismatch" in one_line_error(*cli("run", "mlp.so"))


def test_bench_compare_needs_onnx_model(cli, mlp_file) -> None:
    code, _, err = cli("compile", str(mlp_file), "-o", "mlp.so")
    assert code == 0, err
    assert "--compare needs the ONNX model" in one_line_error(
        *cli("bench", "mlp.so", "--compare", "onnxruntime"))


def test_demo_runs_bundled_model(cli) -> None:
    code, out, err = cli("demo", "--model", "mobilenet_cnn", "--repeat", "3")
    assert code == 0, err
    assert "matches onnxruntime (rtol=atol=0.0001): yes" in out
    assert "onnxruntime" in out.splitlines()[-1]
