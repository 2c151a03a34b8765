"""Helpers shared by subcommands: reading shapes, loading models or artifacts."""

from __future__ import annotations

import os

from .. import build, load
from ..errors import InputError
from ..runtime import CompiledModel
from ..runtime.artifact import MAGIC
from ..runtime.remote import RemoteDevice
from ..targets import DEFAULT_TARGET


def parse_input_shapes(items: list[str] | None) -> dict[str, list]:
    """`NAME=1,3,224,224` (a dim may be a symbol name) -> {NAME: [1, 3, 224, 224]}."""
    shapes = {}
    for item in items or []:
        name, sep, dims = item.rpartition("=")
        if not sep or not name or not dims:
            raise InputError(f"--input-shape expects NAME=D0,D1,..., got '{item}'")
        shapes[name] = [int(d) if d.strip().isdigit() else d.strip() for d in dims.split(",")]
    return shapes


def add_target_args(parser) -> None:
    parser.add_argument("-t", "--target", default=DEFAULT_TARGET, type=parse_targets,
                        help="registered target (default llvm), or several separated by commas "
                             "to place the model's ops across their devices (vulkan,llvm)")
    parser.add_argument("--pin", action="append", metavar="OP=TARGET",
                        help="with several targets: put an ONNX op type or node name on TARGET "
                             "(repeatable)")
    parser.add_argument(
        "--input-shape",
        action="append",
        metavar="NAME=D0,D1,...",
        help="fix an input's shape (repeatable); other symbolic dims stay symbolic",
    )


def parse_targets(text: str) -> str | list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    return names[0] if len(names) == 1 else names


def parse_pins(items: list[str] | None) -> dict[str, str] | None:
    pins = {}
    for item in items or []:
        op, sep, target = item.rpartition("=")
        if not sep or not op or not target:
            raise InputError(f"--pin expects OP=TARGET, got '{item}'")
        pins[op] = target
    return pins or None


def build_from_args(path: str, args, **options) -> CompiledModel:
    """`build` with the target, input shape and pin options of the command line."""
    return build(path, args.target, input_shapes=parse_input_shapes(args.input_shape),
                 pins=parse_pins(args.pin), **options)


def add_remote_args(parser) -> None:
    group = parser.add_argument_group("remote device (TVM RPC)")
    group.add_argument("--rpc", metavar="HOST:PORT", help="run on the RPC server at HOST:PORT")
    group.add_argument("--tracker", metavar="HOST:PORT", help="get a device from this tracker")
    group.add_argument("--key", help="device key to request from the tracker")
    group.add_argument("--rpc-timeout", type=float, default=60.0,
                       help="seconds each remote step may take (default 60)")
    group.add_argument("--auth-key-file", metavar="FILE",
                       help="key of an authenticated server or tracker (default "
                            "$GIMLET_RPC_AUTH_KEY_FILE)")


def remote_device(args) -> RemoteDevice | None:
    """The remote device the command line names, or None to run locally."""
    if args.rpc is None and args.tracker is None:
        return None
    return RemoteDevice(server=args.rpc, tracker=args.tracker, key=args.key, timeout=args.rpc_timeout,
                        auth_key_file=args.auth_key_file)


def is_artifact(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - len(MAGIC)))
        return f.read() == MAGIC


def model_or_artifact(path: str, args) -> CompiledModel:
    """Load `path` as an artifact if it is one, else compile it as an ONNX model."""
    if is_artifact(path):
        return load(path)
    return build_from_args(path, args)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A plain aligned text table."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
