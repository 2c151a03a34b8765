"""The `gimlet-tvm` command line: one module per subcommand, each with `add_parser` and `run`.

Bad input (a GimletError) prints one line, `gimlet-tvm: error: ...`, and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from ..errors import GimletError
from . import bench, compile, demo, records, rpc, run, runtime_bundle, select, targets, tune

SUBCOMMANDS = (compile, run, bench, targets, demo, rpc, runtime_bundle, tune, records, select)


def _version() -> str:
    import tvm
    import tvm_ffi

    from .. import __version__

    return f"gimlet-tvm {__version__} (TVM {tvm.__version__}, tvm-ffi {tvm_ffi.__version__})"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gimlet-tvm", description="Compile ONNX models with TVM for your devices."
    )
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads for running (default: all cores)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.threads is not None:
        # Read by TVM's thread pool when it starts, which is after this point.
        os.environ["TVM_NUM_THREADS"] = str(args.threads)
    try:
        return args.handler(args) or 0
    except GimletError as err:
        print(f"gimlet-tvm: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gimlet-tvm: interrupted", file=sys.stderr)
        return 130
