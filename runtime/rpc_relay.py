"""The shared-key handshake of authenticated TVM RPC, and the client's relay that speaks it.

Standard library only: the relay runs as a child process of its own (`python rpc_relay.py`),
started by `rpc_auth.Relay`, and must not load TVM.

The handshake (mutual HMAC-SHA256 challenge and response; the key never crosses the network):

    gate   -> client  MAGIC, server nonce (32 bytes)
    client -> gate    client nonce (32 bytes), HMAC(key, "client" + server nonce + client nonce)
    gate   -> client  ACCEPTED and HMAC(key, "server" + both nonces), or REFUSED and it closes

After it the gate pipes bytes both ways to TVM's server or tracker. The traffic that follows is
not encrypted.

The relay listens on 127.0.0.1 for TVM's own client (which speaks plain TVM RPC), and for each
connection dials the remote gate, does the handshake, then pipes. For a tracker it reads the
tracker's messages too: a device the tracker hands out is announced as a local relay of its own
(so the session to that server is authenticated as well), and a server registering through it
(`--advertise-port`) is announced at its gate's port, not at TVM's internal one.

Protocol of the child: the key (hex) on the first line of stdin, then stdin stays open (its end
means the parent is gone, and so the relay ends); stdout says `port N` once listening, then one
line per failed connection: `auth: ...` (refused, or no handshake) or `net: ...`.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import hmac
import json
import os
import socket
import struct
import sys
import threading

MAGIC = b"gimlet-tvm-rpc-auth/1\n"
NONCE_BYTES = 32
PROOF_BYTES = 32
ACCEPTED, REFUSED = b"\x01", b"\x00"
HANDSHAKE_TIMEOUT = 5.0

# TVM's tracker protocol (tvm.rpc.base): a magic number each way, then length-prefixed JSON.
TRACKER_MAGIC = 0x2F271
SUCCESS, PUT, REQUEST, UPDATE_INFO = 0, 3, 4, 5


class HandshakeRefused(Exception):
    """The other side refused the key, did not prove it holds it, or did not speak the handshake."""


def _proof(key: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, side + server_nonce + client_nonce, hashlib.sha256).digest()


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    """`size` bytes from `sock`; ConnectionError if it closes first."""
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("connection closed")
        data += chunk
    return data


def gate_handshake(sock: socket.socket, key: bytes) -> bool:
    """The gate's side of the handshake: True when the client proved it holds `key`."""
    server_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + server_nonce)
    answer = recv_exactly(sock, NONCE_BYTES + PROOF_BYTES)
    client_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _proof(key, b"client", server_nonce, client_nonce)):
        sock.sendall(REFUSED)
        return False
    sock.sendall(ACCEPTED + _proof(key, b"server", server_nonce, client_nonce))
    return True


def client_handshake(sock: socket.socket, key: bytes) -> None:
    """The client's side: returns once the gate accepted `key` and proved it holds it too;
    raises HandshakeRefused otherwise."""
    try:
        hello = recv_exactly(sock, len(MAGIC) + NONCE_BYTES)
    except OSError:
        hello = b""
    if not hello.startswith(MAGIC):
        raise HandshakeRefused("it did not start the key handshake (is it a gimlet-tvm server or "
                               "tracker started with --auth-key-file?)")
    server_nonce, client_nonce = hello[len(MAGIC):], os.urandom(NONCE_BYTES)
    sock.sendall(client_nonce + _proof(key, b"client", server_nonce, client_nonce))
    try:
        verdict = recv_exactly(sock, 1 + PROOF_BYTES)
    except OSError:
        verdict = REFUSED
    if verdict[:1] != ACCEPTED:
        raise HandshakeRefused("it refused the key (a different key than the one it was started with)")
    if not hmac.compare_digest(verdict[1:], _proof(key, b"server", server_nonce, client_nonce)):
        raise HandshakeRefused("it does not hold the key: not the server or tracker meant")


def pipe(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways (a thread each way) until either side closes; then close both."""
    threading.Thread(target=_copy, args=(b, a), daemon=True).start()
    _copy(a, b)


def _copy(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    for sock in (src, dst):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


def _recv_frame(sock: socket.socket) -> bytes:
    (size,) = struct.unpack("<i", recv_exactly(sock, 4))
    return recv_exactly(sock, size)


def _frame(message: object) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack("<i", len(data)) + data


class Forwarder:
    """Listens on 127.0.0.1; each connection is authenticated to `remote` and piped there."""

    def __init__(self, remote: tuple[str, int], key: bytes, tracker: bool,
                 advertise: tuple[str | None, int] | None, report):
        self.remote, self.key, self.tracker, self.advertise = remote, key, tracker, advertise
        self._report = report
        self._server_relays: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def serve(self) -> None:
        """Accept forever, a thread per connection."""
        while True:
            conn, _ = self.listener.accept()
            threading.Thread(target=self._forward, args=(conn,), daemon=True).start()

    def _forward(self, conn: socket.socket) -> None:
        where = f"{self.remote[0]}:{self.remote[1]}"
        try:
            upstream = socket.create_connection(self.remote, timeout=HANDSHAKE_TIMEOUT)
        except OSError as err:
            self._report(f"net: cannot reach {where}: {err.strerror or err}")
            conn.close()
            return
        try:
            client_handshake(upstream, self.key)
        except (HandshakeRefused, OSError) as err:
            self._report(f"auth: authentication with {where} failed: {err}")
            upstream.close()
            conn.close()
            return
        upstream.settimeout(None)
        if self.tracker:
            self._relay_tracker(conn, upstream)
        else:
            pipe(conn, upstream)

    def _relay_tracker(self, conn: socket.socket, upstream: socket.socket) -> None:
        """Pipe a tracker connection message by message, rewriting the addresses it carries."""
        requests: collections.deque = collections.deque()
        local_host = upstream.getsockname()[0]

        def up() -> None:
            upstream.sendall(recv_exactly(conn, 4))  # the magic number
            while True:
                message = json.loads(_recv_frame(conn))
                requests.append(message[0])
                upstream.sendall(_frame(self._announced(message, local_host)))

        def down() -> None:
            conn.sendall(recv_exactly(upstream, 4))
            while True:
                message = json.loads(_recv_frame(upstream))
                code = requests.popleft() if requests else None
                if code == REQUEST and isinstance(message, list) and message[0] == SUCCESS:
                    host, port, matchkey = message[1]
                    message = [SUCCESS, ["127.0.0.1", self._server_relay(host, port), matchkey]]
                conn.sendall(_frame(message))

        threading.Thread(target=_until_closed, args=(down, conn, upstream), daemon=True).start()
        _until_closed(up, conn, upstream)

    def _announced(self, message: list, local_host: str) -> list:
        """A server's registration, at its gate's address rather than TVM's internal one."""
        if self.advertise is None or message[0] not in (PUT, UPDATE_INFO):
            return message
        host = self.advertise[0] or local_host
        if message[0] == PUT:  # [PUT, key, [port, matchkey], custom_addr]
            return [PUT, message[1], [self.advertise[1], message[2][1]], host]
        info = dict(message[1], addr=[host, self.advertise[1]])  # [UPDATE_INFO, {key, addr}]
        return [UPDATE_INFO, info]

    def _server_relay(self, host: str, port: int) -> int:
        """The local port of a relay to the server at host:port (one per server, kept)."""
        with self._lock:
            if (host, port) not in self._server_relays:
                relay = Forwarder((host, port), self.key, False, None, self._report)
                threading.Thread(target=relay.serve, daemon=True).start()
                self._server_relays[(host, port)] = relay.port
            return self._server_relays[(host, port)]


def _until_closed(step, *socks: socket.socket) -> None:
    try:
        step()
    except Exception:  # pylint: disable=broad-except  # a side closed, or a message not understood
        pass
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--tracker", action="store_true", help="the remote side is a tracker")
    parser.add_argument("--advertise-host", help="announce registering servers at this host")
    parser.add_argument("--advertise-port", type=int, help="announce registering servers at this port")
    args = parser.parse_args()
    key = bytes.fromhex(sys.stdin.readline().strip())
    lock = threading.Lock()
    os.set_blocking(sys.stdout.fileno(), False)

    def report(line: str) -> None:
        with lock:
            try:
                os.write(sys.stdout.fileno(), line.replace("\n", " ").encode() + b"\n")
            except BlockingIOError:  # the parent has not read the earlier ones: drop it
                pass

    advertise = None if args.advertise_port is None else (args.advertise_host, args.advertise_port)
    relay = Forwarder((args.host, args.port), key, args.tracker, advertise, report)
    report(f"port {relay.port}")
    threading.Thread(target=relay.serve, daemon=True).start()
    sys.stdin.read()  # returns when the parent closes stdin or exits
    os._exit(0)


if __name__ == "__main__":
    main()
