"""TVM RPC: a real tracker and real servers on 127.0.0.1, started through our CLI."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from gimlet_tvm import build
from gimlet_tvm.errors import GimletError, InputError, RemoteDeviceError
from gimlet_tvm.models import SUITE
from gimlet_tvm.runtime.remote import RemoteDevice

from .conftest import assert_matches, compiled_suite_model
from .test_runtime_checks import CASES, embedding

SCRIPT = os.path.join(os.path.dirname(sys.executable), "gimlet-tvm")
KEYS = ("cpu-a", "cpu-b")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Service:
    """A `gimlet-tvm rpc ...` process in its own process group, killed with its children."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [SCRIPT, "rpc", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        line = self.proc.stdout.readline()  # "... listening on HOST:PORT ..."
        assert "listening on" in line, line + self.proc.stderr.read()
        self.address = line.split("listening on ")[1].split()[0]

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def tracker():
    service = Service("tracker", "--port", str(free_port()))
    servers = [
        Service("server", "--port", str(free_port()), "--tracker", service.address, "--key", key)
        for key in KEYS
    ]
    time.sleep(3)  # servers register with the tracker
    yield service.address
    for process in [*servers, service]:
        process.stop()


@pytest.fixture
def server():
    service = Service("server", "--port", str(free_port()))
    yield service
    service.stop()


@pytest.mark.parametrize("key", KEYS)
def test_run_and_benchmark_through_each_server(tracker, key: str) -> None:
    model = compiled_suite_model("transformer_encoder")
    inputs = SUITE["transformer_encoder"].example_inputs(batch=2)
    with model.remote(RemoteDevice(tracker=tracker, key=key, timeout=60)) as remote:
        assert_matches(remote(*inputs.values()), model(*inputs.values()))
        result = remote.benchmark(list(inputs.values()), repeat=3)
    assert result.runs == 3 and result.median_ms > 0


def test_cli_run_and_bench_via_tracker(tracker, cli, tmp_path) -> None:
    model = compiled_suite_model("mlp")
    model.export(tmp_path / "mlp.so")
    inputs = SUITE["mlp"].example_inputs(batch=2)
    np.savez(tmp_path / "in.npz", **inputs)
    code, out, err = cli("run", "mlp.so", "--inputs", "in.npz", "--outputs", "out.npz",
                         "--tracker", tracker, "--key", "cpu-b")
    assert code == 0, err
    assert "ran on device 'cpu-b' via tracker" in out
    with np.load(tmp_path / "out.npz") as outputs:
        assert_matches([outputs["y"]], model(*inputs.values()))
    code, out, err = cli("bench", "mlp.so", "--tracker", tracker, "--key", "cpu-a", "--repeat", "3")
    assert code == 0, err
    assert "on device 'cpu-a' via tracker" in out and "3 runs" in out


def test_direct_server_and_loaded_artifact(server, tmp_path) -> None:
    import gimlet_tvm

    compiled_suite_model("mobilenet_cnn").export(tmp_path / "m.so")
    loaded = gimlet_tvm.load(tmp_path / "m.so")
    inputs = SUITE["mobilenet_cnn"].example_inputs(batch=1)
    with loaded.remote(RemoteDevice(server=server.address, timeout=60)) as remote:
        assert_matches(remote(*inputs.values()), loaded(*inputs.values()))


def test_bad_index_on_a_remote_device_is_an_input_error(server) -> None:
    """A kernel's failed index check comes back over RPC as the same InputError as locally,
    and the remote model runs on."""
    _, good, name, where, bad = CASES["Gather"]
    spoiled = {name: good[name].copy()}
    spoiled[name][where] = bad
    with build(embedding(), "llvm").remote(RemoteDevice(server=server.address, timeout=60)) as remote:
        with pytest.raises(InputError, match=f"Gather: input '{name}' holds index {bad}"):
            remote.run(spoiled)
        assert remote.run(good)["y"].shape == (2, 5, 8)


def test_killed_server_gives_clear_error(server) -> None:
    model = compiled_suite_model("mobilenet_cnn")
    remote = model.remote(RemoteDevice(server=server.address, timeout=20))
    server.signal(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RemoteDeviceError, match=f"RPC server {server.address}: '(copy inputs|run)'"):
        remote(*SUITE["mobilenet_cnn"].example_inputs(batch=1).values())
    assert time.monotonic() - start < 25


def test_hung_server_times_out(server) -> None:
    model = compiled_suite_model("mobilenet_cnn")
    remote = model.remote(RemoteDevice(server=server.address, timeout=10))
    server.signal(signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(RemoteDeviceError, match="got no answer within 10 s"):
            remote(*SUITE["mobilenet_cnn"].example_inputs(batch=1).values())
        assert time.monotonic() - start < 20
    finally:
        server.signal(signal.SIGCONT)


def test_device_is_released_for_the_next_client(tracker) -> None:
    """A closed remote model frees its server: the tracker hands the device on at once."""
    model = compiled_suite_model("mobilenet_cnn")
    inputs = SUITE["mobilenet_cnn"].example_inputs(batch=1)
    for _ in range(2):
        with model.remote(RemoteDevice(tracker=tracker, key="cpu-a", timeout=30)) as remote:
            assert_matches(remote(*inputs.values()), model(*inputs.values()))


def test_no_server_listening() -> None:
    device = RemoteDevice(server=f"127.0.0.1:{free_port()}", timeout=10)
    with pytest.raises(RemoteDeviceError, match="'connect' failed"):
        device.connect()


def test_bad_addresses_are_named() -> None:
    with pytest.raises(GimletError, match="must be HOST:PORT, got 'nowhere'"):
        RemoteDevice(server="nowhere").connect()
    with pytest.raises(GimletError, match="needs a device key"):
        RemoteDevice(tracker="127.0.0.1:1")


def test_server_warns_when_exposed(cli) -> None:
    proc = subprocess.Popen([SCRIPT, "rpc", "server", "--host", "0.0.0.0", "--insecure", "--port",
                             str(free_port())], stderr=subprocess.PIPE, text=True,
                            stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        assert "WARNING: listening on all interfaces" in proc.stderr.readline()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_tune_through_the_tracker(tracker, tmp_path) -> None:
    from gimlet_tvm.schedules.tuning.records import RecordsDB
    from gimlet_tvm.tuning import tune

    from .test_tuning import SMALL, tiny_model

    records = tmp_path / "records"
    result = tune(tiny_model(), "llvm", str(records), trials=4,
                  remote=RemoteDevice(tracker=tracker, key="cpu-b"), **SMALL)
    assert result.trials_run >= 4
    measured = [r for r in RecordsDB(str(records)).records if r.seconds is not None]
    assert measured, "no candidate was measured on the remote device"


def test_tuning_survives_losing_one_of_two_servers(tmp_path) -> None:
    import threading

    from gimlet_tvm.schedules.tuning.records import RecordsDB
    from gimlet_tvm.tuning import tune

    from .test_tuning import SMALL, tiny_model

    pool_tracker = Service("tracker", "--port", str(free_port()))
    servers = [Service("server", "--port", str(free_port()), "--tracker", pool_tracker.address,
                       "--key", "pool") for _ in range(2)]
    records = tmp_path / "records"
    outcome: list = []
    try:
        time.sleep(3)
        worker = threading.Thread(target=lambda: outcome.append(tune(
            tiny_model(), "llvm", str(records), trials=12, runner_timeout=5,
            remote=RemoteDevice(tracker=pool_tracker.address, key="pool"), log=open(os.devnull, "w"),
            **SMALL)))
        worker.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (records.exists() and RecordsDB(str(records)).records):
            time.sleep(0.5)
        servers[0].stop()  # lose one server while tuning runs
        worker.join(timeout=300)
        assert not worker.is_alive(), "tuning hung after losing a server"
    finally:
        for service in [*servers, pool_tracker]:
            service.stop()
    assert outcome and outcome[0].trials_run >= 12
    db = RecordsDB(str(records))
    assert not db.problems and sum(r.seconds is not None for r in db.records) >= 4


def test_select_on_a_remote_server(server, cli, tmp_path) -> None:
    """Kernel selection over RPC: candidates built here, checked and timed on the server; the
    good external kernel passes, the wrong one is rejected by its result, the crashing one by the session it broke
    (the server lives on), and the model builds with the remote choice."""
    import json
    import re

    import onnx

    from .test_kernel_selection import K, M, _matmul_model, write_external_kernels

    kernels = tmp_path / "kernels"
    kernels.mkdir()
    write_external_kernels(kernels)
    model_path = tmp_path / "matmul.onnx"
    onnx.save(_matmul_model(), model_path)
    code, out, err = cli("select", str(model_path), "--records", str(tmp_path / "records"), "--kernels",
                         str(kernels), "--input-shape", f"x={M},{K}", "--rpc", server.address,
                         "--rpc-timeout", "30")
    assert code == 0, err
    # The good one passes every check there, the poisoned runs of the kernel on its own too.
    assert re.search(r"external:good +yes +\d", out), out
    assert re.search(r"external:wrong +no: wrong result at matmul", out), out
    assert re.search(rf"external:crash +no: broke its remote session: RPC server {server.address}", out), out
    assert re.search(r"handwritten:cpu_gemm_6x2v +yes +\d", out), out
    assert re.search(r"generated:tir +yes +\d", out), out  # checked after the crash: the server serves on
    assert "model builds with the selection" in out
    assert server.proc.poll() is None
    stored = json.loads((tmp_path / "records" / "gimlet_kernel_selection.json").read_text())
    assert [entry["device"] for entry in stored["targets"].values()] == [f"RPC server {server.address}"]


def test_select_stops_when_the_remote_device_is_lost(server) -> None:
    from gimlet_tvm.compiler import resolve_target
    from gimlet_tvm.frontend import import_model
    from gimlet_tvm.selection.select import select_kernels

    from .test_kernel_selection import K, M, _matmul_model

    mod, _ = import_model(_matmul_model(), {"x": [M, K]})
    _, target = resolve_target("llvm")
    server.stop()
    with pytest.raises(RemoteDeviceError, match=f"RPC server {server.address} was lost during kernel selection"):
        select_kernels(mod, target, remote=RemoteDevice(server=server.address, timeout=10))
