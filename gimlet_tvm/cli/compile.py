"""`gimlet-tvm compile MODEL -t TARGET -o OUT`: compile an ONNX model to one artifact file."""

from __future__ import annotations

import time

from .. import build
from .common import add_target_args, parse_input_shapes


def add_parser(sub) -> None:
    parser = sub.add_parser("compile", help="compile an ONNX model to an artifact")
    parser.add_argument("model", help="ONNX model file")
    parser.add_argument("-o", "--output", required=True, help="artifact to write (e.g. out.so)")
    add_target_args(parser)
    parser.add_argument("--records", metavar="DIR", help="apply tuning records (gimlet-tvm tune)")
    parser.set_defaults(handler=run)


def run(args) -> int:
    start = time.perf_counter()
    model = build(
        args.model, args.target, input_shapes=parse_input_shapes(args.input_shape),
        records=args.records,
    )
    model.export(args.output)
    seconds = time.perf_counter() - start
    print(f"compiled {args.model} for {model.targets[0]['name']} in {seconds:.1f} s -> {args.output}")
    if args.records:
        print(f"  tuned kernels: {model.targets[0]['tuned_tasks']} from {args.records}")
    code = model.targets[0]["device_code"]
    if code["kernels"]:
        print(f"  device code: {code['format']}, {len(code['kernels'])} kernels, "
              f"checked with {code['checked_with']}")
    for kind, specs in (("input", model.inputs), ("output", model.outputs)):
        for spec in specs:
            print(f"  {kind:6} {spec.describe()}")
    return 0
