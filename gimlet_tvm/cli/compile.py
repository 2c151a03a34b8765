"""`gimlet-tvm compile MODEL -t TARGET -o OUT`: compile an ONNX model to one artifact file."""

from __future__ import annotations

import time

from .common import add_target_args, build_from_args


def add_parser(sub) -> None:
    parser = sub.add_parser("compile", help="compile an ONNX model to an artifact")
    parser.add_argument("model", help="ONNX model file")
    parser.add_argument("-o", "--output", required=True, help="artifact to write (e.g. out.so)")
    add_target_args(parser)
    parser.add_argument("--records", metavar="DIR", help="apply tuning records (gimlet-tvm tune)")
    parser.add_argument("--placement-graph", metavar="FILE",
                        help="with several targets: draw the placement (.png, .svg or .dot)")
    parser.set_defaults(handler=run)


def run(args) -> int:
    start = time.perf_counter()
    model = build_from_args(args.model, args, records=args.records)
    model.export(args.output)
    seconds = time.perf_counter() - start
    names = "+".join(t["name"] for t in model.targets)
    print(f"compiled {args.model} for {names} in {seconds:.1f} s -> {args.output}")
    if args.records:
        print(f"  tuned kernels: {model.targets[0]['tuned_tasks']}, kernels chosen by selection: "
              f"{model.targets[0]['selected_kernels']} from {args.records}")
    for built_for in model.targets:
        code = built_for["device_code"]
        if code["kernels"]:
            print(f"  {built_for['name']} device code: {code['format']}, {len(code['kernels'])} "
                  f"kernels, checked with {code['checked_with']}")
    if len(model.targets) > 1:
        print(model.placement())
        if args.placement_graph:
            model.placement().write_graph(args.placement_graph)
    for kind, specs in (("input", model.inputs), ("output", model.outputs)):
        for spec in specs:
            print(f"  {kind:6} {spec.describe()}")
    return 0
