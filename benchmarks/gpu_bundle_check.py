"""GPU check on the device, from the runtime bundle: every artifact in manifest.json run on
its device, compared with the reference outputs (onnxruntime, computed where it was
prepared) and timed. Prints a Markdown table; exits 1 if an artifact that could run failed or
gave wrong outputs (artifacts for a device this machine lacks are reported as skipped).

    python3 check.py [--repeat 50] [--targets cuda llvm]

Written next to the artifacts by `benchmarks/gpu_bundle.py prepare OUT_DIR`; needs only Python
3.11, numpy and the device driver. Each artifact runs in a child process, so a kernel that
crashes costs its row, not the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "runtime", "python"))  # the runtime bundle
os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")  # TVM's runtime-only mode

import numpy as np  # noqa: E402

import gimlet_tvm  # noqa: E402


def check_one(entry: dict, repeat: int) -> dict:
    """Load, run, compare and time one artifact (in this process)."""
    try:
        model = gimlet_tvm.load(os.path.join(HERE, entry["artifact"]))
        with np.load(os.path.join(HERE, entry["inputs"])) as data:
            inputs = {name: data[name] for name in data.files}
        outputs = model.run(inputs)
    except gimlet_tvm.TargetUnavailableError as err:
        return {"status": "skipped", "detail": str(err)}
    with np.load(os.path.join(HERE, entry["reference"])) as data:
        reference = {name: data[name] for name in data.files}
    diff = max(float(np.max(np.abs(outputs[name].astype(np.float64) - want)))
               for name, want in reference.items())
    ok = all(np.allclose(outputs[name], want, rtol=entry["tolerance"], atol=entry["tolerance"])
             for name, want in reference.items())
    timing = model.benchmark(inputs, repeat=repeat)
    return {"status": "ok" if ok else "WRONG", "max_abs_diff": diff,
            "median_ms": timing.median_ms, "p10_ms": timing.p10_ms, "p90_ms": timing.p90_ms}


def run_isolated(entry: dict, repeat: int) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--one", json.dumps(entry),
               "--repeat", str(repeat)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=HERE)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "detail": "no answer within 600 s"}
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        last = (result.stderr.strip().splitlines() or ["?"])[-1]
        return {"status": "failed", "detail": f"exit {result.returncode}: {last}"}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--targets", nargs="+", help="only these targets (default: all)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a manifest entry, in a child
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(check_one(json.loads(args.one), args.repeat)), flush=True)
        return 0
    with open(os.path.join(HERE, "manifest.json")) as f:
        entries = json.load(f)["artifacts"]
    print("| model | target | batch | result | max abs diff | median ms (p10-p90) |")
    print("|---|---|---|---|---|---|")
    failed = False
    for entry in entries:
        if args.targets and entry["target"] not in args.targets:
            continue
        row = run_isolated(entry, args.repeat)
        failed |= row["status"] in ("failed", "WRONG")
        diff = f"{row['max_abs_diff']:.2g}" if "max_abs_diff" in row else "-"
        time = (f"{row['median_ms']:.3f} ({row['p10_ms']:.3f}-{row['p90_ms']:.3f})"
                if "median_ms" in row else row.get("detail", "-"))
        print(f"| {entry['model']} | {entry['target']} | {entry['batch']} | {row['status']} | "
              f"{diff} | {time} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
