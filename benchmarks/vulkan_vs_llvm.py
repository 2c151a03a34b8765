"""Vulkan (lavapipe here) against LLVM CPU: the model suite on both, each checked against
onnxruntime, then timed.

    .venv/bin/python benchmarks/vulkan_vs_llvm.py [--models mlp ...] [--batch 1] [--repeat 10]

Correctness is the point on lavapipe (Mesa's Vulkan driver running shaders on the CPU); its
timings say little about a real GPU. Each engine is timed in its own block (not interleaved:
lavapipe's worker threads and TVM's pool would compete for the same cores), after one untimed
warm-up run (which for Vulkan also creates the pipelines). Prints a Markdown table; exits 1 if
any output differs from onnxruntime by more than rtol = atol = 1e-4.
"""

from __future__ import annotations

import argparse
import sys
import time

import gimlet_tvm
from gimlet_tvm.models import SUITE
from gimlet_tvm.peers import check_against_onnxruntime

TOLERANCE = 1e-4
TARGETS = ("vulkan", "llvm")


def measure(name: str, target: str, batch: int, repeat: int) -> dict:
    """Build `name` for `target`, check it against onnxruntime and time it."""
    info = SUITE[name]
    proto = info.build()
    start = time.perf_counter()
    model = gimlet_tvm.build(proto, target)
    compile_s = time.perf_counter() - start
    inputs = info.example_inputs(batch=batch)
    ok, diff = check_against_onnxruntime(proto, model, inputs, TOLERANCE)
    timing = model.benchmark(inputs, repeat=repeat, warmup=1)
    return {"ok": ok, "diff": diff, "compile_s": compile_s,
            "median_ms": timing.median_ms,
            "kernels": len(model.targets[0]["device_code"]["kernels"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=[n for n, i in SUITE.items() if i.in_tests])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args(argv)
    rows = [
        "| model | target | matches onnxruntime (1e-4) | max abs diff | compile s | median ms | kernels |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    failed = False
    for name in args.models:
        for target in TARGETS:
            r = measure(name, target, args.batch, args.repeat)
            failed |= not r["ok"]
            kernels = r["kernels"] if target == "vulkan" else "-"
            rows.append(
                f"| {name} | {target} | {'yes' if r['ok'] else 'NO'} | {r['diff']:.2g} | "
                f"{r['compile_s']:.1f} | {r['median_ms']:.2f} | {kernels} |"
            )
            print(rows[-1], file=sys.stderr, flush=True)
    print(f"batch {args.batch}, {args.repeat} timed runs each; Vulkan device: "
          f"{gimlet_tvm.targets.lookup('vulkan')[0].facts().get('device')}\n")
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
