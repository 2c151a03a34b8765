"""`gimlet-tvm rpc server|tracker`: TVM's RPC server and tracker, with our runtime loaded.

TVM RPC has no authentication of its own and lets any client run code on the server. With
`--auth-key-file` (or `$GIMLET_RPC_AUTH_KEY_FILE`) clients must prove they hold the key before
any byte reaches TVM (`runtime.rpc_auth`). Both bind to 127.0.0.1 unless told otherwise; an
address other machines reach needs a key or `--insecure`, and always gets a warning.
"""

from __future__ import annotations

from tvm.rpc.tracker import Tracker

from ..runtime.remote import Listening, behind_gate, serve_until_stopped, start_server
from ..runtime.rpc_auth import Gate, add_auth_args, listening_key


def add_parser(sub) -> None:
    parser = sub.add_parser("rpc", help="run a TVM RPC server or tracker for remote devices")
    roles = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    server = roles.add_parser("server", help="serve this machine's devices")
    _add_listening_args(server, 9090)
    server.add_argument("--tracker", help="register with the tracker at HOST:PORT")
    server.add_argument("--key", default="", help="device key announced to the tracker")
    server.set_defaults(handler=run_server)
    tracker = roles.add_parser("tracker", help="hand out devices registered by servers")
    _add_listening_args(tracker, 9190)
    tracker.set_defaults(handler=run_tracker)


def _add_listening_args(parser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--port-end", type=int, help="try ports up to this one (default +100)")
    add_auth_args(parser)


def _port_end(args) -> int:
    return args.port_end if args.port_end is not None else args.port + 100


def run_server(args) -> int:
    server = start_server(args.host, args.port, _port_end(args), args.tracker, args.key,
                          args.auth_key_file, args.insecure)
    return serve_until_stopped("RPC server", args.host, server.port, server.stop)


def run_tracker(args) -> int:
    tracker = start_tracker(args.host, args.port, _port_end(args), args.auth_key_file, args.insecure)
    return serve_until_stopped("RPC tracker", args.host, tracker.port, tracker.stop)


def start_tracker(host: str, port: int, port_end: int, auth_key_file: str | None = None,
                  insecure: bool = False) -> Listening:
    """TVM's RPC tracker. With a key file (or `$GIMLET_RPC_AUTH_KEY_FILE`) it listens on
    127.0.0.1 behind a `Gate` on `host`, as `start_server` does; without one, an address other
    machines reach is refused unless `insecure`."""
    secret = listening_key(host, auth_key_file, insecure)

    def tracker(tracker_host: str, tracker_port: int, tracker_end: int) -> Tracker:
        return Tracker(host=tracker_host, port=tracker_port, port_end=tracker_end, silent=True)

    if secret is None:
        started = tracker(host, port, port_end)
        return Listening(started.port, started.terminate)
    return behind_gate(Gate(host, port, port_end, secret), tracker)
