"""Shared fixtures: the model suite, built and compiled once per test session."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest

import gimlet_tvm
from gimlet_tvm.models import SUITE
from gimlet_tvm.peers import onnxruntime_session

pytest_plugins = ["tests.rpc_plugin"]

TEST_MODELS = [name for name, info in SUITE.items() if info.in_tests]
TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}


REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> types.ModuleType:
    """A script of the repository (`benchmarks/gpu_check.py`) loaded as a module, for tests.
    It is registered in `sys.modules` under its file's stem, as when the scripts import each
    other (and as dataclasses need for their annotations)."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def suite_model(name: str) -> onnx.ModelProto:
    return SUITE[name].build()


@functools.lru_cache(maxsize=None)
def compiled_suite_model(name: str) -> gimlet_tvm.CompiledModel:
    return gimlet_tvm.build(suite_model(name), "llvm")


def onnxruntime_outputs(model: onnx.ModelProto, inputs: dict) -> list[np.ndarray]:
    return onnxruntime_session(model, threads=1).run(None, inputs)


def assert_matches(ours: list[np.ndarray], reference: list[np.ndarray]) -> None:
    assert len(ours) == len(reference)
    for got, want in zip(ours, reference):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, **TOLERANCE)


@pytest.fixture
def cli(tmp_path):
    """Run the real `gimlet-tvm` console script; returns (exit code, stdout, stderr)."""
    import subprocess

    script = os.path.join(os.path.dirname(sys.executable), "gimlet-tvm")

    def run(*args: str, input: str | None = None) -> tuple[int, str, str]:
        proc = subprocess.run(
            [script, *args], capture_output=True, text=True, cwd=tmp_path, timeout=600, input=input
        )
        return proc.returncode, proc.stdout, proc.stderr

    return run
