"""GPU check on the device, from the runtime bundle: every artifact in manifest.json run on
its device, compared with the reference outputs (onnxruntime, computed where it was
prepared) and timed; where the device has onnxruntime with the matching execution provider
(CPU for llvm, CUDA for cuda), the same model is timed there too, in its own process at its
default threading, numpy in and out like ours. Prints a Markdown table; exits 1 if an artifact
that could run failed or gave wrong outputs (artifacts for a device this machine lacks are
reported as skipped).

    python3 check.py [--repeat 50] [--targets cuda llvm]

Written next to the artifacts by `benchmarks/gpu_bundle.py prepare OUT_DIR`; needs only Python
(3.11, or a version the bundle was prepared for), numpy and the device driver. Each artifact runs in a child process, so a kernel that
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

import time  # noqa: E402

import numpy as np  # noqa: E402

import gimlet_tvm  # noqa: E402

try:
    import onnxruntime  # the peer, where the device has it
except ImportError:
    onnxruntime = None

PEER_PROVIDERS = {"llvm": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
"""onnxruntime's execution provider that runs where an artifact of each target runs."""


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


def time_peer(entry: dict, repeat: int) -> dict:
    """onnxruntime on the artifact's model and inputs (in this process), on the provider for
    its target: 5 untimed calls, then `repeat` timed ones."""
    provider = PEER_PROVIDERS.get(entry["target"])
    if onnxruntime is None or provider not in onnxruntime.get_available_providers():
        return {"status": "skipped", "detail": f"no onnxruntime with {provider}"}
    session = onnxruntime.InferenceSession(os.path.join(HERE, entry["onnx"]), providers=[provider])
    with np.load(os.path.join(HERE, entry["inputs"])) as data:
        inputs = {name: data[name] for name in data.files}
    for _ in range(5):
        session.run(None, inputs)
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        session.run(None, inputs)
        samples.append((time.perf_counter() - start) * 1e3)
    p10, median, p90 = np.percentile(samples, [10, 50, 90])
    return {"status": "ok", "median_ms": median, "p10_ms": p10, "p90_ms": p90}


def run_isolated(entry: dict, repeat: int, peer: bool = False) -> dict:
    """`check_one` (or `time_peer`) in a child process."""
    command = [sys.executable, os.path.abspath(__file__), "--peer" if peer else "--one",
               json.dumps(entry), "--repeat", str(repeat)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=HERE)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "detail": "no answer within 600 s"}
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        last = (result.stderr.strip().splitlines() or ["?"])[-1]
        return {"status": "failed", "detail": f"exit {result.returncode}: {last}"}
    return json.loads(lines[-1])


def _times(row: dict) -> str:
    if "median_ms" not in row:
        return row.get("detail", "-")
    return f"{row['median_ms']:.3f} ({row['p10_ms']:.3f}-{row['p90_ms']:.3f})"


def _ratio(row: dict, peer: dict) -> str:
    if "median_ms" not in row or "median_ms" not in peer:
        return "-"
    return f"{row['median_ms'] / peer['median_ms']:.2f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--targets", nargs="+", help="only these targets (default: all)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a manifest entry, in a child
    parser.add_argument("--peer", help=argparse.SUPPRESS)  # a manifest entry, onnxruntime's turn
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(check_one(json.loads(args.one), args.repeat)), flush=True)
        return 0
    if args.peer:
        print(json.dumps(time_peer(json.loads(args.peer), args.repeat)), flush=True)
        return 0
    with open(os.path.join(HERE, "manifest.json")) as f:
        entries = json.load(f)["artifacts"]
    print("| model | target | batch | result | max abs diff | median ms (p10-p90) "
          "| onnxruntime ms (p10-p90) | ours / onnxruntime |")
    print("|---|---|---|---|---|---|---|---|")
    failed = False
    for entry in entries:
        if args.targets and entry["target"] not in args.targets:
            continue
        row = run_isolated(entry, args.repeat)
        failed |= row["status"] in ("failed", "WRONG")
        diff = f"{row['max_abs_diff']:.2g}" if "max_abs_diff" in row else "-"
        peer = run_isolated(entry, args.repeat, peer=True) if "onnx" in entry else {}
        print(f"| {entry['model']} | {entry['target']} | {entry['batch']} | {row['status']} | "
              f"{diff} | {_times(row)} | {_times(peer)} | {_ratio(row, peer)} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
