"""`gimlet-tvm run ARTIFACT --inputs in.npz --outputs out.npz`: run a compiled model."""

from __future__ import annotations

from ..runtime import random_inputs
from ..runtime.tensors import read_npz, write_npz
from .common import add_remote_args, add_target_args, model_or_artifact, remote_device


def add_parser(sub) -> None:
    parser = sub.add_parser("run", help="run an artifact (or an ONNX model, compiled first)")
    parser.add_argument("artifact", help="artifact from `compile`, or an ONNX model")
    parser.add_argument("--inputs", help=".npz with one array per input name (default: random)")
    parser.add_argument("--outputs", help=".npz to write the outputs to")
    add_target_args(parser)
    add_remote_args(parser)
    parser.set_defaults(handler=run)


def run(args) -> int:
    model = model_or_artifact(args.artifact, args)
    device = remote_device(args)
    runner = model.remote(device) if device else model
    if args.inputs:
        inputs = read_npz(args.inputs)
    else:
        inputs = dict(zip(model.input_names, random_inputs(model.io)))
        print("no --inputs given: using random inputs (symbolic dims = 1)")
    outputs = runner.run(inputs)
    if device:
        print(f"ran on {device.describe()}")
    for name, array in outputs.items():
        print(f"  {name}: {array.dtype}{list(array.shape)}")
    if args.outputs:
        write_npz(args.outputs, outputs)
        print(f"outputs written to {args.outputs}")
    return 0
