"""benchmarks/gpu_bundle.py: prepared here, its check.py runs the CPU artifacts from the runtime
bundle beside onnxruntime and reports the CUDA ones as skipped (no GPU here); the folder fits the
device's 64 MiB and carries the extensions of the H200 machines' Python (3.12) too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .conftest import load_script


def test_prepared_check_runs_the_cpu_part(tmp_path) -> None:
    out = tmp_path / "gpu"
    script = load_script("benchmarks/gpu_bundle.py")
    assert script.main(["prepare", str(out), "--targets", "cuda", "llvm", "--models", "mobilenet_cnn"]) == 0
    assert script.size_of(out) <= script.MAX_BYTES
    entries = json.loads((out / "manifest.json").read_text())["artifacts"]
    assert [e["target"] for e in entries] == ["cuda", "llvm"]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, out / "check.py", "--repeat", "2"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| mobilenet")]
    assert [(row[1], row[3]) for row in rows] == [("cuda", "skipped"), ("llvm", "ok")]
    assert rows[0][6] == "no onnxruntime with CUDAExecutionProvider"
    assert float(rows[1][6].split()[0]) > 0 and rows[1][7].rstrip(" |").endswith("x")
    python = out / "runtime" / "python"
    for pattern in ("tvm_ffi/core.cpython-312-*.so", "ml_dtypes/_ml_dtypes_ext.cpython-312-*.so"):
        assert [path.read_bytes()[:4] for path in python.glob(pattern)] == [b"\x7fELF"]
