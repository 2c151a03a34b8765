"""Authenticated TVM RPC: a real tracker and server on 127.0.0.1 started with a key file; clients
without the key, or with a wrong one, are refused before they can upload; with it, run, bench,
select and tune work as without authentication."""

from __future__ import annotations

import os
import socket
import time

import pytest

from gimlet_tvm.errors import GimletError, RPCAuthError
from gimlet_tvm.models import SUITE
from gimlet_tvm.runtime import rpc_relay
from gimlet_tvm.runtime.remote import RemoteDevice
from gimlet_tvm.runtime.rpc_auth import KEY_FILE_ENV, listening_key, read_key

from .conftest import assert_matches, compiled_suite_model
from .test_rpc import Service, free_port

DEVICE = "cpu-auth"


def _key_file(path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("keys")
    return {"right": _key_file(folder / "right", "a-shared-secret-of-32-characters\n"),
            "wrong": _key_file(folder / "wrong", "another-secret-also-32-characters")}


@pytest.fixture(scope="module")
def farm(keys):
    """An authenticated tracker with a server registered under DEVICE, and a server of its own
    (one registered with a tracker admits only the clients the tracker sends)."""
    tracker = Service("tracker", "--port", str(free_port()), "--auth-key-file", keys["right"])
    services = [tracker, *(Service("server", "--port", str(free_port()), "--auth-key-file",
                                   keys["right"], *extra)
                           for extra in (("--tracker", tracker.address, "--key", DEVICE), ()))]
    time.sleep(3)  # the server registers with the tracker
    yield {"tracker": tracker.address, "server": services[2].address}
    for service in services:
        service.stop()


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def test_a_client_without_the_key_gets_no_tvm_byte(farm) -> None:
    """The gate opens with its challenge; an answer that is no proof is refused and the
    connection closed: nothing reaches TVM's server (its RPC magic never comes back)."""
    with socket.create_connection(_address(farm["server"]), timeout=10) as sock:
        hello = rpc_relay.recv_exactly(sock, len(rpc_relay.MAGIC) + rpc_relay.NONCE_BYTES)
        assert hello.startswith(rpc_relay.MAGIC)
        sock.sendall(b"\xff" * (rpc_relay.NONCE_BYTES + rpc_relay.PROOF_BYTES))
        assert sock.recv(100) == rpc_relay.REFUSED
        assert sock.recv(100) == b""


def test_tvm_client_without_the_key_is_refused(farm, monkeypatch) -> None:
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    for device in (RemoteDevice(server=farm["server"], timeout=10),
                   RemoteDevice(tracker=farm["tracker"], key=DEVICE, timeout=10)):
        with pytest.raises(RPCAuthError, match="admits only clients holding its key"):
            device.connect()


def test_a_wrong_key_is_refused(farm, keys) -> None:
    for device in (RemoteDevice(server=farm["server"], timeout=10, auth_key_file=keys["wrong"]),
                   RemoteDevice(tracker=farm["tracker"], key=DEVICE, timeout=10,
                                auth_key_file=keys["wrong"])):
        with pytest.raises(RPCAuthError, match="refused the key"):
            device.connect()
        with pytest.raises(RPCAuthError, match="refused the key"):
            device.check_key()


def test_a_server_with_a_wrong_key_cannot_register(farm, keys, cli) -> None:
    code, _, err = cli("rpc", "server", "--port", str(free_port()), "--tracker", farm["tracker"],
                       "--key", DEVICE, "--auth-key-file", keys["wrong"])
    assert code == 2 and "registering with the tracker: authentication with" in err
    assert "refused the key" in err


def test_cli_without_the_key_is_one_line_and_code_2(farm, cli, tmp_path) -> None:
    compiled_suite_model("mlp").export(tmp_path / "mlp.so")
    code, _, err = cli("run", "mlp.so", "--rpc", farm["server"], "--rpc-timeout", "10")
    assert code == 2 and err.startswith("gimlet-tvm: error: RPC server") and "--auth-key-file" in err
    assert len(err.strip().splitlines()) == 1, err


def test_run_and_benchmark_with_the_key(farm, keys) -> None:
    model = compiled_suite_model("transformer_encoder")
    inputs = SUITE["transformer_encoder"].example_inputs(batch=2)
    for device in (RemoteDevice(server=farm["server"], auth_key_file=keys["right"]),
                   RemoteDevice(tracker=farm["tracker"], key=DEVICE, auth_key_file=keys["right"])):
        with model.remote(device) as remote:
            assert_matches(remote(*inputs.values()), model(*inputs.values()))
            assert remote.benchmark(list(inputs.values()), repeat=3).runs == 3


def test_cli_bench_with_the_key(farm, keys, cli, tmp_path) -> None:
    compiled_suite_model("mlp").export(tmp_path / "mlp.so")
    code, out, err = cli("bench", "mlp.so", "--tracker", farm["tracker"], "--key", DEVICE,
                         "--auth-key-file", keys["right"], "--repeat", "3")
    assert code == 0, err
    assert f"on device '{DEVICE}' via tracker" in out and "3 runs" in out


def test_the_environment_names_the_key_file(farm, keys, monkeypatch) -> None:
    monkeypatch.setenv(KEY_FILE_ENV, keys["right"])
    model = compiled_suite_model("mlp")
    inputs = SUITE["mlp"].example_inputs(batch=2)
    with model.remote(RemoteDevice(server=farm["server"])) as remote:
        assert_matches(remote(*inputs.values()), model(*inputs.values()))


@pytest.mark.slow
def test_select_with_the_key(farm, keys) -> None:
    from gimlet_tvm.compiler import resolve_target
    from gimlet_tvm.frontend import import_model
    from gimlet_tvm.selection.select import select_kernels

    from .test_kernel_selection import K, M, _matmul_model

    mod, _ = import_model(_matmul_model(), {"x": [M, K]})
    _, target = resolve_target("llvm")
    device = RemoteDevice(server=farm["server"], timeout=30, auth_key_file=keys["right"])
    selection = select_kernels(mod, target, remote=device)
    assert selection.choices and selection.device == device.describe()


@pytest.mark.slow
def test_tune_through_the_authenticated_tracker(farm, keys, tmp_path) -> None:
    """MetaSchedule's runner dials the local relay; the servers the tracker hands out are
    reached through it too."""
    from gimlet_tvm.schedules.tuning.records import RecordsDB
    from gimlet_tvm.tuning import tune

    from .test_tuning import SMALL, tiny_model

    records = tmp_path / "records"
    device = RemoteDevice(tracker=farm["tracker"], key=DEVICE, auth_key_file=keys["right"])
    result = tune(tiny_model(), "llvm", str(records), trials=4, remote=device, select=False, **SMALL)
    assert result.trials_run >= 4
    assert [r for r in RecordsDB(str(records)).records if r.seconds is not None]


def test_tune_with_a_wrong_key_stops_at_once(farm, keys, tmp_path) -> None:
    from gimlet_tvm.tuning import tune

    from .test_tuning import SMALL, tiny_model

    device = RemoteDevice(tracker=farm["tracker"], key=DEVICE, auth_key_file=keys["wrong"])
    with pytest.raises(RPCAuthError, match="refused the key"):
        tune(tiny_model(), "llvm", str(tmp_path / "records"), trials=4, remote=device, **SMALL)


def test_exposed_without_a_key_needs_insecure(keys, monkeypatch, capsys) -> None:
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    assert listening_key("127.0.0.1", None, False) is None and not capsys.readouterr().err
    with pytest.raises(GimletError, match="refusing to listen on all interfaces without --auth-key-file"):
        listening_key("0.0.0.0", None, False)
    assert listening_key("0.0.0.0", None, True) is None
    assert "anyone who can reach this port can run code" in capsys.readouterr().err
    assert listening_key("192.0.2.7", keys["right"], False) == read_key(keys["right"])
    err = capsys.readouterr().err
    assert "WARNING: listening on 192.0.2.7" in err and "not encrypted" in err
    monkeypatch.setenv(KEY_FILE_ENV, keys["right"])
    assert listening_key("127.0.0.1", None, False) == read_key(keys["right"])


def test_cli_refuses_an_exposed_tracker_without_a_key(cli, monkeypatch) -> None:
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    code, out, err = cli("rpc", "tracker", "--host", "0.0.0.0", "--port", str(free_port()))
    assert code == 2 and "listening on" not in out
    assert err.startswith("gimlet-tvm: error: refusing to listen on all interfaces") and "--insecure" in err


def test_key_files_checked(tmp_path, capsys) -> None:
    with pytest.raises(RPCAuthError, match="holds 5 bytes, a key needs at least 16"):
        read_key(_key_file(tmp_path / "short", "short"))
    with pytest.raises(RPCAuthError, match="cannot read the RPC key file"):
        read_key(str(tmp_path / "missing"))
    shared = _key_file(tmp_path / "shared", "a-shared-secret-of-32-characters")
    os.chmod(shared, 0o644)
    assert read_key(shared) == b"a-shared-secret-of-32-characters"
    assert "readable by every user" in capsys.readouterr().err
