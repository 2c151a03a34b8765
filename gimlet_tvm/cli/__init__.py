"""The `gimlet-tvm` command line: one module per subcommand, each with `add_parser` and `run`.

Bad input (a GimletError) prints one line, `gimlet-tvm: error: ...`, and exits with code 2.
TVM's C++ log lines are dropped unless `--verbose` (or `GIMLET_LOG=debug`) asks for them;
our own warnings print as `gimlet-tvm: warning: ...`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

import tvm
import tvm_ffi

from .. import __version__
from ..errors import GimletError
from ..logs import quiet_tvm_logs, set_verbose, verbose
from . import bench, chat, compile, demo, generate, records, rpc, run, runtime_bundle, select, serve, targets, tune

SUBCOMMANDS = (compile, run, bench, targets, demo, rpc, runtime_bundle, tune, records, select, generate, chat,
               serve)


def _version() -> str:
    return f"gimlet-tvm {__version__} (TVM {tvm.__version__}, tvm-ffi {tvm_ffi.__version__})"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gimlet-tvm", description="Compile ONNX models with TVM for your devices."
    )
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads for running (default: all cores)"
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true",
        help="also print TVM's own log lines and our debug messages (same as GIMLET_LOG=debug)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"gimlet-tvm: {record.levelname.lower()}: {record.getMessage()}"


def _print_our_messages() -> None:
    """Our loggers' messages (logger `gimlet_tvm`) to stderr, one line each; debug ones too
    when verbose."""
    logger = logging.getLogger("gimlet_tvm")
    if not any(isinstance(h.formatter, _Formatter) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(_Formatter())
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if verbose() else logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.threads is not None:
        # Read by TVM's thread pool when it starts, which is after this point.
        os.environ["TVM_NUM_THREADS"] = str(args.threads)
    if args.verbose:
        set_verbose(True)  # in the environment: child processes inherit it
    _print_our_messages()
    try:
        with quiet_tvm_logs():
            return args.handler(args) or 0
    except GimletError as err:
        print(f"gimlet-tvm: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gimlet-tvm: interrupted", file=sys.stderr)
        return 130
