"""Cross-device placement on the model suite: CPU only, the device only, and the placed
build over both, each checked against onnxruntime and timed in the same run.

    .venv/bin/python benchmarks/placement.py [--device vulkan] [--models ...] [--batch 1]
        [--repeat 10] [--pin MatMul=vulkan ...] [--costs roofline|measured] [--graphs DIR]

`--device cuda` on a machine with an NVIDIA GPU gives the llvm+cuda partition against
cuda-only and cpu-only. Each configuration is timed in its own block after one warm-up run
(not interleaved: on lavapipe the device's worker threads share the host's cores). Prints a
Markdown table with the placement (ops per device, copies and bytes, modelled latency);
`--graphs` writes each placement as a PNG. Exits 1 if any output differs from onnxruntime
by more than rtol = atol = 1e-4.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import gimlet_tvm
from gimlet_tvm.models import SUITE
from gimlet_tvm.peers import check_against_onnxruntime

TOLERANCE = 1e-4


def measure(name: str, targets, batch: int, repeat: int, pins: dict, costs: str,
            graphs: str | None) -> dict:
    info = SUITE[name]
    proto = info.build()
    start = time.perf_counter()
    placed = isinstance(targets, list)
    options = {"pins": pins or None, "placement_costs": costs} if placed else {}
    model = gimlet_tvm.build(proto, targets, **options)
    compile_s = time.perf_counter() - start
    inputs = info.example_inputs(batch=batch)
    ok, diff = check_against_onnxruntime(proto, model, inputs, TOLERANCE)
    timing = model.benchmark(inputs, repeat=repeat, warmup=1)
    summary = "-"
    if placed:
        report = model.placement()
        per_device = ", ".join(f"{d} {n}" for d, n in report.ops_per_device().items())
        summary = (f"{per_device}; {len(report.copies)} copies ({report.copy_bytes} B); "
                   f"modelled {report.modelled_ms:.3f} ms ({costs})")
        if graphs:
            report.write_graph(os.path.join(graphs, f"{name}-{'+'.join(targets)}.png"))
    return {"ok": ok, "diff": diff, "compile_s": compile_s,
            "timing": timing, "placed": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="vulkan")
    parser.add_argument("--models", nargs="+", default=[n for n, i in SUITE.items() if i.in_tests])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--pin", nargs="*", default=[], help="OP_TYPE_OR_NODE=TARGET")
    parser.add_argument("--costs", choices=("roofline", "measured"), default="roofline",
                        help="op times for placement: estimated, or measured on the devices")
    parser.add_argument("--graphs", help="folder for placement pictures")
    args = parser.parse_args(argv)
    pins = dict(p.split("=", 1) for p in args.pin)
    if args.graphs:
        os.makedirs(args.graphs, exist_ok=True)
    configurations = [("llvm", "cpu only"), (args.device, f"{args.device} only"),
                      ([args.device, "llvm"], "placed" + (f" (pins {args.pin})" if pins else ""))]
    rows = ["| model | build | matches onnxruntime | max abs diff | compile s | median ms (p10-p90) | placement |",
            "|---|---|---|---:|---:|---:|---|"]
    failed = False
    for name in args.models:
        for targets, label in configurations:
            r = measure(name, targets, args.batch, args.repeat, pins, args.costs, args.graphs)
            failed |= not r["ok"]
            t = r["timing"]
            rows.append(f"| {name} | {label} | {'yes' if r['ok'] else 'NO'} | {r['diff']:.2e} | "
                        f"{r['compile_s']:.1f} | {t.median_ms:.3f} ({t.p10_ms:.3f}-{t.p90_ms:.3f}) | "
                        f"{r['placed']} |")
            print(rows[-1], flush=True)
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
