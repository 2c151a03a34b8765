"""Running compiled models on remote devices through TVM RPC (a server, or a tracker + key).

Every step against the remote side (connect, upload, load, copy inputs, run, fetch outputs)
runs under a deadline: a server that dies or stops answering gives a `RemoteDeviceError`
naming the device and the step, never a hang. TVM RPC has no authentication of its own: with a
key file, servers and trackers admit only clients that prove they hold the key (`rpc_auth`).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import sys
import tempfile
import threading
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, TypeVar

import numpy as np
import tvm
from tvm import rpc
from tvm.rpc import server
from tvm.runtime.vm import VirtualMachine

from ..carriers import from_carrier
from ..errors import GimletError, RemoteDeviceError, RPCAuthError, summary
from ..io_spec import IOSpec
from .index_checks import input_error
from .libraries import load_available
from .rpc_auth import (ALL_INTERFACES, KEY_FILE_ENV, Gate, Relay, asks_for_key, check_key, key_file,
                       listening_key, loopback_port, read_key, relay_for)
from .tensors import device_tensors, to_numpy
from .timing import BenchmarkResult

if TYPE_CHECKING:  # compiled_model imports this module: the type only, for annotations
    from .compiled_model import CompiledModel

T = TypeVar("T")


def parse_address(address: str, what: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise GimletError(f"{what} must be HOST:PORT, got '{address}'")
    return host, int(port)


@dataclasses.dataclass(frozen=True)
class RemoteDevice:
    """Where to run: an RPC server (`server="host:port"`) or a tracker and a device key;
    `auth_key_file` (default `$GIMLET_RPC_AUTH_KEY_FILE`): the key of an authenticated one."""

    server: str | None = None
    tracker: str | None = None
    key: str | None = None
    timeout: float = 60.0
    auth_key_file: str | None = None

    def __post_init__(self):
        if (self.server is None) == (self.tracker is None):
            raise GimletError("give either an RPC server address or a tracker address")
        if self.tracker is not None and not self.key:
            raise GimletError("a tracker needs a device key (--key)")
        object.__setattr__(self, "auth_key_file", key_file(self.auth_key_file))

    def describe(self) -> str:
        if self.server is not None:
            return f"RPC server {self.server}"
        return f"device '{self.key}' via tracker {self.tracker}"

    def address(self) -> tuple[str, int]:
        """Where TVM's own client dials the server or tracker: its address, or with a key file
        the local relay that authenticates for it (`rpc_auth.Relay`)."""
        return self._relay().address if self.auth_key_file else self._remote_address()

    def _remote_address(self) -> tuple[str, int]:
        if self.server is not None:
            return parse_address(self.server, "the RPC server address")
        return parse_address(self.tracker, "the tracker address")

    def _relay(self) -> Relay:
        return relay_for(self._remote_address(), self.auth_key_file, tracker=self.server is None)

    def check_key(self) -> None:
        """With a key file: one handshake with the server or tracker, so that a refused key is
        an `RPCAuthError` now (MetaSchedule's runner, dialing through the relay, would only
        report failed candidates)."""
        if self.auth_key_file:
            try:
                check_key(self._remote_address(), read_key(self.auth_key_file))
            except RemoteDeviceError as err:
                raise type(err)(f"{self.describe()}: {err}") from None

    def connect(self) -> rpc.RPCSession:
        """A session on the device; the server ends it after `timeout` x 10 seconds."""
        session_timeout = self.timeout * 10
        host, port = self.address()
        if self.server is not None:
            return self.call("connect", lambda: rpc.connect(host, port, session_timeout=session_timeout))
        return self.call(
            "connect",
            lambda: rpc.connect_tracker(host, port).request(
                self.key, session_timeout=session_timeout, max_retry=2
            ),
        )

    def call(self, step: str, func: Callable[[], T]) -> T:
        """Run one remote step with the deadline; failures name the device and the step.

        The step runs on a daemon thread: one stuck in a dead connection is abandoned, and
        does not keep the process from exiting."""
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(_attempt(func)), daemon=True)
        thread.start()
        thread.join(self.timeout)
        if not outcome:
            raise RemoteDeviceError(
                f"{self.describe()}: '{step}' got no answer within {self.timeout:g} s"
            )
        ok, value = outcome[0]
        if ok:
            return value
        if isinstance(value, GimletError):
            raise value
        failure = self._relay().failure() if self.auth_key_file else None
        kind, _, reason = (failure or "").partition(": ")
        if kind == "auth":
            raise RPCAuthError(f"{self.describe()}: {reason}") from None
        if step == "connect" and not self.auth_key_file and asks_for_key(self._remote_address()):
            raise RPCAuthError(f"{self.describe()}: it admits only clients holding its key (give "
                               f"--auth-key-file, or ${KEY_FILE_ENV})") from None
        reason = reason if kind == "net" else summary(value)
        raise RemoteDeviceError(f"{self.describe()}: '{step}' failed: {reason}") from value


def _attempt(func: Callable[[], T]) -> tuple[bool, T | BaseException]:
    try:
        return True, func()
    except Exception as err:  # socket and RPC errors come in many types
        return False, err


class RemoteModel:
    """A `CompiledModel` uploaded to and loaded on a remote device; same calling API.

    It holds the remote session (and so the device, for a tracker) until `close()` or the
    end of a `with` block."""

    def __init__(self, model: "CompiledModel", device: RemoteDevice, session: rpc.RPCSession):
        self.io: IOSpec = model.io
        self.output_names = model.output_names
        self._device = device
        self._session = session
        with tempfile.TemporaryDirectory(prefix="gimlet-rpc-") as folder:
            path = os.path.join(folder, "model.so")
            model.export(path)
            device.call("upload", lambda: session.upload(path))
        module = device.call("load", lambda: session.load_module("model.so"))
        self._remote_device = session.device(model.device.dlpack_device_type(), 0)
        self._vm = device.call(
            "load", lambda: VirtualMachine(module, self._remote_device)
        )

    def close(self) -> None:
        """Release the remote session, so the tracker can hand the device to others.

        A device from `session.device()` holds its session too, and TVM's RPC objects form
        reference cycles: the session ends only once the cycle collector has run."""
        self._vm = self._session = self._remote_device = None
        gc.collect()

    def __enter__(self) -> "RemoteModel":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _set_inputs(self, arrays: Sequence[np.ndarray]) -> None:
        def copy() -> None:
            self._vm.set_input("main", *device_tensors(arrays, self._remote_device))

        self._device.call("copy inputs", copy)

    def _execute(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        self._set_inputs(arrays)

        def run() -> None:
            try:
                self._vm.invoke_stateful("main")
            except Exception as err:  # pylint: disable=broad-except
                error = input_error(err, {spec.name: a for spec, a in zip(self.io.inputs, arrays)})
                if error is None:
                    raise
                raise error from None  # a kernel's check of run-time values, as on a local device
        self._device.call("run", run)
        result = self._device.call("fetch outputs", lambda: self._vm.get_outputs("main"))
        flat = list(result) if isinstance(result, (list, tuple)) else [result]
        return self._device.call("fetch outputs", lambda: [
            from_carrier(to_numpy(v), spec.dtype) for v, spec in zip(flat, self.io.outputs)])

    def __call__(self, *arrays: Any) -> list[np.ndarray]:
        return self._execute(self.io.order_inputs(arrays))

    def run(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self._execute(self.io.order_inputs((), inputs))))

    def benchmark(self, inputs: Sequence[Any], *, repeat: int = 50) -> BenchmarkResult:
        """Time `repeat` runs on the remote device, measured there (no network in the time)."""
        self._set_inputs(self.io.order_inputs(inputs))
        evaluator = self._vm.time_evaluator("invoke_stateful", self._remote_device, repeat=repeat, number=1)
        result = self._device.call("benchmark", lambda: evaluator("main"))
        return BenchmarkResult.from_samples(list(result.results))


# Calls a server function whose parameters are typed `ffi.Tensor`: TVM RPC hands tensors over as
# bare `DLTensor*` views, which such a function refuses. In the server's Python each view is
# copied into a tensor of its own for the call, and copied back after it (it may be an output).
# Views live only for the call, so an array that outlives it (a model's parameters) must hold
# copies of its own: OWNED_ARRAY makes one.
CALL_WITH_TENSORS = "gimlet.rpc.call_with_tensors"
OWNED_ARRAY = "gimlet.rpc.owned_array"


def _owned(view: tvm.runtime.Tensor) -> tvm.runtime.Tensor:
    return tvm.runtime.empty(view.shape, view.dtype, view.device).copyfrom(view)


def _call_with_tensors(name: str, *args: Any) -> Any:
    views = {i: arg for i, arg in enumerate(args) if isinstance(arg, tvm.runtime.Tensor)}
    owned = {i: _owned(view) for i, view in views.items()}
    result = tvm.get_global_func(name)(*(owned.get(i, arg) for i, arg in enumerate(args)))
    for i, view in views.items():
        view.copyfrom(owned[i])
    return result


def _owned_array(*tensors: tvm.runtime.Tensor) -> Any:
    return tvm.runtime.convert([_owned(view) for view in tensors])


def init_server() -> None:
    """RPC server start-up hook (in the server's process): load the runtime library of every
    target that can run here so remote artifacts find its functions, and keep serving after a
    session whose process died.

    TVM's server runs each session in a child process and stops listening for good when that
    child exits with an error (its `_serving` raises on the exit code): one kernel that
    crashes (a candidate being checked, a bad tuning trial) would take the device away from
    every later client. The session's client gets its error; the server serves the next one."""
    load_available()
    tvm.register_global_func(CALL_WITH_TENSORS, _call_with_tensors, override=True)
    tvm.register_global_func(OWNED_ARRAY, _owned_array, override=True)
    serving = server._serving  # pylint: disable=protected-access

    def serve_one_session(sock, addr, opts, load_library) -> None:
        cwd = os.getcwd()
        try:
            serving(sock, addr, opts, load_library)
        except RuntimeError as err:  # "Child process N exited unsuccessfully ..."
            os.chdir(cwd)
            sock.close()
            print(f"gimlet-tvm rpc server: session from {addr[0]} failed ({err}); serving on",
                  file=sys.stderr, flush=True)

    server._serving = serve_one_session  # pylint: disable=protected-access


@dataclasses.dataclass(frozen=True)
class Listening:
    """A started server or tracker: the port clients dial, and how to stop it."""

    port: int
    stop: Callable[[], None]


def start_server(host: str, port: int, port_end: int, tracker: str | None = None, key: str = "",
                 auth_key_file: str | None = None, insecure: bool = False) -> Listening:
    """TVM's RPC server with gimlet's runtime in its sessions (`init_server`), registered with
    `tracker` ("HOST:PORT") if given: what `gimlet-tvm rpc server` and the runtime bundle's
    rpc_server.py run.

    With a key file (or `$GIMLET_RPC_AUTH_KEY_FILE`) TVM's server listens on 127.0.0.1 behind
    a `Gate` on `host`, and registers with the tracker through a `Relay` that announces the
    gate's port. Without one, an address other machines reach is refused unless `insecure`
    (`listening_key`)."""
    secret = listening_key(host, auth_key_file, insecure)
    tracker_addr = parse_address(tracker, "--tracker") if tracker else None
    if secret is None:
        server = _tvm_server(host, port, port_end, tracker_addr, key)
        return Listening(server.port, server.terminate)
    gate = Gate(host, port, port_end, secret)
    if tracker_addr is not None:
        _check_tracker_key(tracker_addr, secret)
        advertised_host = None if host in ALL_INTERFACES else host  # None: as the tracker sees us
        relay = Relay(tracker_addr, secret, tracker=True, advertise=(advertised_host, gate.port))
        tracker_addr = relay.address
    return behind_gate(gate, lambda inner_host, inner_port, inner_end:
                   _tvm_server(inner_host, inner_port, inner_end, tracker_addr, key))


def behind_gate(gate: Gate, start: Callable[[str, int, int], Any]) -> Listening:
    """`start(host, port, port_end)` (a TVM server or tracker) on a free loopback port, opened
    to clients through `gate`: what listens is the gate; stopping closes both. (The tracker
    is the CLI's alone: TVM's needs tornado, which the runtime bundle does not carry.)"""
    internal = loopback_port()
    inner = start("127.0.0.1", internal, internal + 100)
    gate.open_to(inner.port)
    return Listening(gate.port, lambda: (gate.close(), inner.terminate()))


def _check_tracker_key(tracker: tuple[str, int], secret: bytes) -> None:
    """A tracker that refuses the server's key is an error now (TVM's server would retry it
    forever, silently); one not up yet is left to TVM's server, which keeps trying."""
    try:
        check_key(tracker, secret)
    except RPCAuthError as err:
        raise RPCAuthError(f"registering with the tracker: {err}") from None
    except RemoteDeviceError:
        pass


def _tvm_server(host: str, port: int, port_end: int, tracker_addr: tuple[str, int] | None,
                key: str) -> rpc.Server:
    return rpc.Server(host=host, port=port, port_end=port_end, tracker_addr=tracker_addr,
                      key=key, server_init_callback=init_server, silent=True)


def serve_until_stopped(kind: str, host: str, port: int, stop: Callable[[], None]) -> int:
    """Say where `kind` listens, wait for Ctrl-C or SIGTERM, then `stop()` it; returns 0."""
    print(f"{kind} listening on {host}:{port} (Ctrl-C to stop)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        stop()
    return 0
