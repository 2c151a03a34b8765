"""The runtime's own command line, for machines without the compiler: the runtime bundle's
`run.py` and `rpc_server.py` (`gimlet-tvm runtime-bundle`) call these.

    python run.py ARTIFACT --inputs in.npz --outputs out.npz [--device cpu|cuda|vulkan]
    python rpc_server.py --host H --port P [--auth-key-file F]

Bad input (a GimletError) prints one line, `gimlet-tvm: error: ...`, and exits with code 2,
as `gimlet-tvm` does.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

import tvm

from ..errors import GimletError, InputError
from .compiled_model import CompiledModel, load
from .remote import serve_until_stopped, start_server
from .rpc_auth import add_auth_args
from .tensors import random_inputs, read_npz, write_npz


def _reporting_errors(main: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return main(args)
    except GimletError as err:
        print(f"gimlet-tvm: error: {err}", file=sys.stderr)
        return 2


def run_and_report(model: CompiledModel, run: Callable[[dict], dict], inputs: str | None,
                   outputs: str | None) -> None:
    """`run` the model on the `inputs` .npz (random inputs without one), print each output's
    dtype and shape, and write them to the `outputs` .npz if given (`run.py`, `gimlet-tvm run`)."""
    if inputs:
        arrays = read_npz(inputs)
    else:
        arrays = dict(zip(model.input_names, random_inputs(model.io)))
        print("no --inputs given: using random inputs (symbolic dims = 1)")
    results = run(arrays)
    for name, array in results.items():
        print(f"  {name}: {array.dtype}{list(array.shape)}")
    if outputs:
        write_npz(outputs, results)
        print(f"outputs written to {outputs}")


def _run(args: argparse.Namespace) -> int:
    model = load(args.artifact)
    if args.device is not None and model.device.dlpack_device_type() != _device_type(args.device):
        raise InputError(f"{args.artifact} is built for '{model.targets[0]['name']}' "
                         f"({model.device}), not for --device {args.device}")
    run_and_report(model, model.run, args.inputs, args.outputs)
    return 0


def _device_type(name: str) -> int:
    try:
        return tvm.device(name, 0).dlpack_device_type()
    except ValueError:
        raise InputError(f"--device {name}: not a TVM device type") from None


def run_main(argv: Sequence[str] | None = None) -> int:
    """`run.py ARTIFACT [--inputs in.npz] [--outputs out.npz] [--device KIND]`."""
    parser = argparse.ArgumentParser(prog="run.py", description="Run a gimlet-tvm artifact.")
    parser.add_argument("artifact", help="artifact from `gimlet-tvm compile` / `model.export`")
    parser.add_argument("--inputs", help=".npz with one array per input name (default: random)")
    parser.add_argument("--outputs", help=".npz to write the outputs to")
    parser.add_argument("--device", metavar="KIND",
                        help="check that the artifact runs on this kind of device (a TVM device type: "
                             "cpu, cuda, vulkan, ...)")
    return _reporting_errors(_run, parser.parse_args(argv))


def _serve(args: argparse.Namespace) -> int:
    port_end = args.port_end if args.port_end is not None else args.port + 100
    server = start_server(args.host, args.port, port_end, args.tracker, args.key,
                          args.auth_key_file, args.insecure)
    return serve_until_stopped("RPC server", args.host, server.port, server.stop)


def rpc_server_main(argv: Sequence[str] | None = None) -> int:
    """`rpc_server.py [--host H] [--port P] [--tracker H:P --key K] [--auth-key-file F]`:
    `gimlet-tvm rpc server`."""
    parser = argparse.ArgumentParser(prog="rpc_server.py",
                                     description="Serve this machine's devices over TVM RPC.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9090)
    parser.add_argument("--port-end", type=int, help="try ports up to this one (default +100)")
    parser.add_argument("--tracker", help="register with the tracker at HOST:PORT")
    parser.add_argument("--key", default="", help="device key announced to the tracker")
    add_auth_args(parser)
    return _reporting_errors(_serve, parser.parse_args(argv))
