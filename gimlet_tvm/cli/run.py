"""`gimlet-tvm run ARTIFACT --inputs in.npz --outputs out.npz`: run a compiled model."""

from __future__ import annotations

from ..runtime.standalone import run_and_report
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
    run_and_report(model, (model.remote(device) if device else model).run, args.inputs, args.outputs)
    if device:
        print(f"ran on {device.describe()}")
    return 0
