"""benchmarks/gpu_check.py, exercised on the CPU target (on a GPU machine it runs on CUDA)."""

from __future__ import annotations

from .conftest import load_script


def test_checks_and_times_on_cpu(capsys) -> None:
    assert load_script("benchmarks/gpu_check.py").main(["--target", "llvm", "--models", "mlp", "--repeat", "2"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1].split(" | ")
    assert row[0] == "| mlp" and row[2] == "yes"
    assert float(row[-1].rstrip(" |")) > 0


def test_fails_clearly_without_the_device(capsys) -> None:
    assert load_script("benchmarks/gpu_check.py").main(["--target", "cuda", "--models", "mlp", "--repeat", "1"]) == 1
    assert "cannot run on this machine" in capsys.readouterr().out
