"""`gimlet-tvm runtime-bundle OUT_DIR`: a folder that runs exported artifacts and serves TVM RPC
on a machine with Python, numpy and the device driver but no TVM (see gimlet_tvm/runtime_bundle.py)."""

from __future__ import annotations

from ..runtime_bundle import MAX_BYTES, make_bundle


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "runtime-bundle",
        help="write a folder that runs artifacts and serves RPC without TVM installed",
    )
    parser.add_argument("out_dir", help="folder to create (must not exist, or be empty)")
    parser.add_argument("--python-version", nargs="+", default=[], metavar="X.Y",
                        help="also carry extension modules for these CPython versions (the "
                             "device's Python, where it differs from this one's)")
    parser.set_defaults(handler=run)


def run(args) -> int:
    size = make_bundle(args.out_dir, tuple(args.python_version))
    print(f"runtime bundle written to {args.out_dir}: {size / 2**20:.1f} MiB "
          f"(limit {MAX_BYTES / 2**20:.0f} MiB)")
    print(f"  python {args.out_dir}/run.py ARTIFACT --inputs in.npz --outputs out.npz")
    print(f"  python {args.out_dir}/rpc_server.py --host HOST --port PORT")
    return 0
