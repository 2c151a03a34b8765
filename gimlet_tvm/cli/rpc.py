"""`gimlet-tvm rpc server|tracker`: TVM's RPC server and tracker, with our runtime loaded.

TVM RPC has no authentication and lets any client run code on the server: both bind to
127.0.0.1 unless told otherwise, and warn loudly when bound to every interface.
"""

from __future__ import annotations

from tvm.rpc.tracker import Tracker

from ..runtime.remote import serve_until_stopped, start_server, warn_if_exposed


def add_parser(sub) -> None:
    parser = sub.add_parser("rpc", help="run a TVM RPC server or tracker for remote devices")
    roles = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    server = roles.add_parser("server", help="serve this machine's devices")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=9090)
    server.add_argument("--port-end", type=int, help="try ports up to this one (default +100)")
    server.add_argument("--tracker", help="register with the tracker at HOST:PORT")
    server.add_argument("--key", default="", help="device key announced to the tracker")
    server.set_defaults(handler=run_server)
    tracker = roles.add_parser("tracker", help="hand out devices registered by servers")
    tracker.add_argument("--host", default="127.0.0.1")
    tracker.add_argument("--port", type=int, default=9190)
    tracker.add_argument("--port-end", type=int, help="try ports up to this one (default +100)")
    tracker.set_defaults(handler=run_tracker)


def _port_end(args) -> int:
    return args.port_end if args.port_end is not None else args.port + 100


def run_server(args) -> int:
    server = start_server(args.host, args.port, _port_end(args), args.tracker, args.key)
    return serve_until_stopped("RPC server", args.host, server.port, server.terminate)


def run_tracker(args) -> int:
    warn_if_exposed(args.host)
    tracker = Tracker(host=args.host, port=args.port, port_end=_port_end(args), silent=True)
    return serve_until_stopped("RPC tracker", args.host, tracker.port, tracker.terminate)
