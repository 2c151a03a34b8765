"""`gimlet-tvm runtime-bundle`: a folder that runs exported artifacts and serves TVM RPC in a
Python that has numpy and nothing else (no TVM), checked against onnxruntime here."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gimlet_tvm.errors import GimletError
from gimlet_tvm.models import SUITE
from gimlet_tvm.runtime.remote import RemoteDevice
from gimlet_tvm.runtime_bundle import MAX_BYTES, add_python_version, make_bundle, size_of

from .conftest import assert_matches, compiled_suite_model, onnxruntime_outputs, suite_model

SERVER_START_S = 240  # its first start builds the runtime extensions (CPU, Vulkan) with g++


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "runtime"
    assert make_bundle(out) == size_of(out)
    return out


@pytest.fixture(scope="module")
def numpy_python(tmp_path_factory) -> Path:
    """A fresh venv with numpy only (from pip's cache or the index); it cannot import TVM."""
    env_dir = tmp_path_factory.mktemp("numpy-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "numpy"], check=True, timeout=300)
    probe = subprocess.run([python, "-c", "import tvm"], capture_output=True, text=True)
    assert "No module named 'tvm'" in probe.stderr
    return python


def _clean_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items()
            if key not in ("PYTHONPATH", "TVM_LIBRARY_PATH", "VIRTUAL_ENV")}


def test_bundle_is_small_and_has_no_compiler(bundle: Path) -> None:
    assert size_of(bundle) <= MAX_BYTES
    libraries = {path.name for path in bundle.rglob("*.so*")}
    assert "libtvm_runtime.so" in libraries
    assert not {"libtvm.so", "libtvm_compiler.so"} & libraries
    assert not (bundle / "python" / "tvm" / "relax").exists()
    assert (bundle / "python" / "gimlet_tvm" / "runtime" / "ext" / "vulkan" / "vulkan_module.cc").is_file()


@pytest.mark.parametrize("name", ["mlp", "transformer_encoder"])
def test_run_py_matches_onnxruntime(bundle: Path, numpy_python: Path, tmp_path, name: str) -> None:
    compiled_suite_model(name).export(tmp_path / "model.so")
    inputs = SUITE[name].example_inputs(batch=2, seed=3)
    np.savez(tmp_path / "in.npz", **inputs)
    result = subprocess.run(
        [numpy_python, bundle / "run.py", "model.so", "--inputs", "in.npz", "--outputs",
         "out.npz", "--device", "cpu"],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    with np.load(tmp_path / "out.npz") as out:
        ours = [out[spec.name] for spec in compiled_suite_model(name).outputs]
    assert_matches(ours, onnxruntime_outputs(suite_model(name), inputs))


def test_run_py_without_a_compiler_uses_the_prebuilt_cpu_library(
        bundle: Path, numpy_python: Path, tmp_path) -> None:
    compiled_suite_model("resnet_cnn").export(tmp_path / "model.so")
    inputs = SUITE["resnet_cnn"].example_inputs(batch=1)
    np.savez(tmp_path / "in.npz", **inputs)
    env = dict(_clean_env(), CXX=str(tmp_path / "no-such-g++"),
               GIMLET_TVM_CACHE=str(tmp_path / "cache"))
    result = subprocess.run([numpy_python, bundle / "run.py", "model.so", "--inputs", "in.npz",
                             "--outputs", "out.npz"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "cache").exists()  # nothing was built
    with np.load(tmp_path / "out.npz") as out:
        assert_matches([out[name] for name in out.files],
                       onnxruntime_outputs(suite_model("resnet_cnn"), inputs))


def test_run_py_names_a_wrong_device(bundle: Path, numpy_python: Path, tmp_path) -> None:
    compiled_suite_model("mlp").export(tmp_path / "model.so")
    result = subprocess.run([numpy_python, bundle / "run.py", "model.so", "--device", "cuda"],
                            cwd=tmp_path, env=_clean_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2
    assert "built for 'llvm'" in result.stderr and "--device cuda" in result.stderr


def _listening_port(server: subprocess.Popen) -> int:
    """The port from the server's "listening on HOST:PORT" line, within SERVER_START_S."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in server.stdout], daemon=True).start()
    deadline, seen = time.monotonic() + SERVER_START_S, []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            assert server.poll() is None, f"RPC server exited: {''.join(seen)}"
            continue
        seen.append(line)
        if "listening on" in line:
            return int(line.split("listening on ")[1].split()[0].rpartition(":")[2])
    raise AssertionError(f"RPC server did not start within {SERVER_START_S} s: {''.join(seen)}")


def test_rpc_server_py_runs_a_model_for_our_client(bundle: Path, numpy_python: Path, tmp_path) -> None:
    """With a key file: the device machines run this server, authenticated."""
    key = tmp_path / "rpc.key"
    key.write_text("a-shared-secret-of-32-characters")
    key.chmod(0o600)
    # Run away from the checkout: TVM's session workers start with `python -m`, which puts the
    # working folder first on their path (and the checkout has a gimlet_tvm folder).
    server = subprocess.Popen(
        [numpy_python, "-u", bundle / "rpc_server.py", "--host", "127.0.0.1", "--port", "9390",
         "--port-end", "9490", "--auth-key-file", key],
        cwd=tmp_path, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)  # its own process group: the session workers go with it
    try:
        port = _listening_port(server)
        model = compiled_suite_model("mlp")
        inputs = SUITE["mlp"].example_inputs(batch=2, seed=4)
        device = RemoteDevice(server=f"127.0.0.1:{port}", timeout=60, auth_key_file=str(key))
        with model.remote(device) as remote:
            ours = list(remote.run(inputs).values())
        assert_matches(ours, onnxruntime_outputs(suite_model("mlp"), inputs))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_extensions_for_a_python_that_has_no_wheel_are_an_error(tmp_path) -> None:
    with pytest.raises(GimletError, match="for Python 2.9"):
        add_python_version(tmp_path, "2.9")
    assert not any(tmp_path.iterdir())
