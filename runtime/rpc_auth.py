"""Authenticated TVM RPC: the shared key file, the gate in front of a server or tracker, the
client's relay to one, and the rule for listening where other machines reach.

TVM RPC has no authentication: whoever reaches a server's port can upload code and run it.
With `--auth-key-file`, TVM's server or tracker listens on 127.0.0.1 only and the public port
is a `Gate`: a connection reaches TVM once it proved it holds the key (the handshake of
`rpc_relay`: 5 s at most, at most 32 under way at once); a refused one is closed before any
TVM byte flows. TVM's client speaks plain TVM RPC, so clients dial a `Relay`: a child process
on 127.0.0.1 that does the handshake for each connection, then pipes. (A process, not threads:
TVM's client holds the GIL in its blocking socket calls, and relay threads beside it starve.)
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import socket
import stat
import subprocess
import sys
import threading
import time

from ..errors import GimletError, RemoteDeviceError, RPCAuthError
from . import rpc_relay

KEY_FILE_ENV = "GIMLET_RPC_AUTH_KEY_FILE"
MIN_KEY_BYTES = 16
MAX_PENDING_HANDSHAKES = 32
ALL_INTERFACES = ("0.0.0.0", "::", "")


def key_file(path: str | None) -> str | None:
    """The key file given, else `$GIMLET_RPC_AUTH_KEY_FILE`, else None (no authentication)."""
    return path or os.environ.get(KEY_FILE_ENV) or None


def read_key(path: str) -> bytes:
    """The key in `path` (surrounding whitespace dropped); warns when other users may read it."""
    try:
        with open(path, "rb") as f:
            key, mode = f.read().strip(), os.fstat(f.fileno()).st_mode
    except OSError as err:
        raise RPCAuthError(f"cannot read the RPC key file {path}: {err.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise RPCAuthError(
            f"the RPC key file {path} holds {len(key)} bytes, a key needs at least {MIN_KEY_BYTES} "
            f"(make one: head -c 32 /dev/urandom | base64 > {path}; chmod 600 {path})")
    if mode & stat.S_IROTH:
        print(f"gimlet-tvm: WARNING: the RPC key file {path} is readable by every user of this "
              f"machine (chmod 600 {path})", file=sys.stderr)
    return key


def is_loopback(host: str) -> bool:
    """Whether only this machine reaches `host` (a host name other than localhost may resolve
    to anything: not loopback)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listening_key(host: str, auth_key_file: str | None, insecure: bool) -> bytes | None:
    """The key a server or tracker listening on `host` authenticates clients with (None: none).

    An address other machines reach is refused without a key, unless `insecure`; with or
    without one, it gets a warning on stderr naming the risk."""
    path = key_file(auth_key_file)
    key = read_key(path) if path else None
    if is_loopback(host):
        return key
    where = "all interfaces" if host in ALL_INTERFACES else host
    if key is None and not insecure:
        raise GimletError(
            f"refusing to listen on {where} without --auth-key-file: anyone who reaches the port "
            "could upload code and run it on this machine (give a key file, or --insecure on a "
            "trusted network)")
    risk = ("TVM RPC has no authentication: anyone who can reach this port can run code on this "
            "machine" if key is None else
            "only clients holding the key get in, but they can run code on this machine, and the "
            "traffic (models, inputs, outputs) is not encrypted")
    print(f"gimlet-tvm: WARNING: listening on {where}. {risk}.", file=sys.stderr)
    return key


def add_auth_args(parser) -> None:
    """`--auth-key-file` and `--insecure` for a server or tracker (`gimlet-tvm rpc`, rpc_server.py)."""
    parser.add_argument("--auth-key-file", metavar="FILE",
                        help="admit only clients that prove they hold the key in FILE (default "
                             f"${KEY_FILE_ENV}; a server uses it with its tracker too)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow listening where other machines reach without a key")


def loopback_port() -> int:
    """A port of 127.0.0.1 free now: where TVM's server or tracker listens behind a gate."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Gate:
    """The public port of an authenticated server or tracker: lets a connection through to
    TVM's, on 127.0.0.1, once it proved it holds the key; closes it otherwise."""

    def __init__(self, host: str, port: int, port_end: int, key: bytes):
        self._key = key
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._sock = _bind(host, port, port_end)
        self.port: int = self._sock.getsockname()[1]

    def open_to(self, upstream_port: int) -> None:
        """Start admitting clients, to TVM's server or tracker at 127.0.0.1:`upstream_port`."""
        threading.Thread(target=self._accept, args=(upstream_port,), daemon=True).start()

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept(self, upstream_port: int) -> None:
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                if self._sock.fileno() < 0:  # closed
                    return
                time.sleep(0.1)  # out of file descriptors, for one: let connections end
                continue
            if not self._pending.acquire(blocking=False):  # too many handshakes under way
                conn.close()
                continue
            threading.Thread(target=self._admit, args=(conn, addr[0], upstream_port), daemon=True).start()

    def _admit(self, conn: socket.socket, peer: str, upstream_port: int) -> None:
        try:
            conn.settimeout(rpc_relay.HANDSHAKE_TIMEOUT)
            admitted = rpc_relay.gate_handshake(conn, self._key)
        except OSError:
            admitted = False
        finally:
            self._pending.release()
        if not admitted:
            print(f"gimlet-tvm: refused a connection from {peer}: it did not prove it holds the key",
                  file=sys.stderr, flush=True)
            conn.close()
            return
        conn.settimeout(None)
        try:  # TVM's clients speak first: a client that only checked its key never reaches TVM
            first = conn.recv(1 << 16)
            upstream = socket.create_connection(("127.0.0.1", upstream_port)) if first else None
            if upstream is not None:
                upstream.sendall(first)
        except OSError:
            upstream = None
        if upstream is None:
            conn.close()
            return
        rpc_relay.pipe(conn, upstream)


def _bind(host: str, port: int, port_end: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for candidate in range(port, max(port_end, port + 1)):
        try:
            return socket.create_server((host, candidate), family=family)
        except OSError:
            continue
    raise GimletError(f"cannot listen on {host}: ports {port} to {max(port_end - 1, port)} are "
                      "taken or not allowed")


def check_key(remote: tuple[str, int], key: bytes) -> None:
    """One handshake with the gate at `remote`, then close: `RPCAuthError` if it refuses `key`."""
    where = f"{remote[0]}:{remote[1]}"
    try:
        with socket.create_connection(remote, timeout=rpc_relay.HANDSHAKE_TIMEOUT) as sock:
            rpc_relay.client_handshake(sock, key)
    except rpc_relay.HandshakeRefused as err:
        raise RPCAuthError(f"authentication with {where} failed: {err}") from None
    except OSError as err:
        raise RemoteDeviceError(f"cannot reach {where}: {err.strerror or err}") from None


def asks_for_key(remote: tuple[str, int]) -> bool:
    """Whether `remote` is a gate (it opens with the handshake): why a client without a key
    failed to connect."""
    try:
        with socket.create_connection(remote, timeout=2) as sock:
            return rpc_relay.recv_exactly(sock, len(rpc_relay.MAGIC)) == rpc_relay.MAGIC
    except OSError:
        return False


class Relay:
    """A child process (`rpc_relay`) listening on 127.0.0.1: each connection TVM's client makes
    to `address` is authenticated to `remote` with `key`, then piped there. For a tracker, the
    servers it hands out are reached through the relay too; `advertise` (host or None for the
    address the tracker sees, port) is where a server registering through it is announced."""

    def __init__(self, remote: tuple[str, int], key: bytes, tracker: bool = False,
                 advertise: tuple[str | None, int] | None = None):
        command = [sys.executable, "-I", "-S", rpc_relay.__file__, remote[0], str(remote[1])]
        if tracker:
            command.append("--tracker")
        if advertise is not None:
            command += ["--advertise-port", str(advertise[1])]
            command += ["--advertise-host", advertise[0]] if advertise[0] else []
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL)
        self._proc.stdin.write(key.hex().encode() + b"\n")
        self._proc.stdin.flush()
        self._out = self._proc.stdout.fileno()
        first = self._line()
        if not first.startswith("port "):
            self.close()
            raise RemoteDeviceError(f"the local relay to {remote[0]}:{remote[1]} did not start")
        self.address: tuple[str, int] = ("127.0.0.1", int(first.split()[1]))
        os.set_blocking(self._out, False)
        atexit.register(self.close)

    def _line(self) -> str:
        data = b""
        while not data.endswith(b"\n") and (byte := os.read(self._out, 1)):
            data += byte
        return data.decode()

    def failure(self) -> str | None:
        """The last connection failure the relay reported since the last call, or None:
        `auth: ...` (refused, or no handshake) or `net: ...` (unreachable)."""
        data = b""
        try:
            while chunk := os.read(self._out, 4096):
                data += chunk
        except BlockingIOError:
            pass
        lines = data.decode(errors="replace").splitlines()
        return lines[-1] if lines else None

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


_relays: dict[tuple, Relay] = {}
_relays_lock = threading.Lock()


def relay_for(remote: tuple[str, int], auth_key_file: str, tracker: bool) -> Relay:
    """This process's relay to `remote` with the key in `auth_key_file` (started once, kept)."""
    slot = (remote, os.path.abspath(auth_key_file), tracker)
    with _relays_lock:
        if slot not in _relays:
            _relays[slot] = Relay(remote, read_key(auth_key_file), tracker)
        return _relays[slot]
