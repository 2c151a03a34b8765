"""Tuning benchmark: untuned vs MetaSchedule-tuned gimlet_tvm vs onnxruntime, and a GEMM table.

    .venv/bin/python benchmarks/tuning.py                        # whole suite, 64 trials a model
    .venv/bin/python benchmarks/tuning.py --models mlp --trials 32 --gemm-sizes 512

Models: each suite model at the batch benchmarks/run.py uses, tuned into
`--records/<model>` (resumable: a rerun reuses the records), then built untuned and tuned
and timed against onnxruntime in interleaved rounds (2 threads, spinning off). Reported as
ratios of medians (below 1: faster than onnxruntime) with the trial budget and tuning time.

GEMM: C = A @ B in fp32, square sizes. numpy/OpenBLAS runs in its own process with
OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset (they can slow OpenBLAS on this machine) and
reports the kernel threadpoolctl sees; its best GFLOP/s is the machine's measured peak.
Ours: a MatMul ONNX model through gimlet_tvm.build (dispatched to OpenBLAS on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

THREADS = 2
for var in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[var] = str(THREADS)

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import BATCH, static_batch  # noqa: E402

import gimlet_tvm  # noqa: E402
from gimlet_tvm.models import SUITE  # noqa: E402
from gimlet_tvm.peers import onnxruntime_session, time_interleaved  # noqa: E402

NUMPY_PEER = r"""
import json, os, sys, time
import numpy as np
n, threads = int(sys.argv[1]), sys.argv[2]
try:
    from threadpoolctl import threadpool_info
    blas = [f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')} x{i.get('num_threads')}"
            for i in threadpool_info() if i.get("user_api") == "blas"]
except ImportError:
    blas = ["threadpoolctl not installed"]
a = np.random.rand(n, n).astype(np.float32); b = np.random.rand(n, n).astype(np.float32)
a @ b
times = []
for _ in range(max(5, int(2e9 / n**3))):
    t = time.perf_counter(); a @ b; times.append(time.perf_counter() - t)
print(json.dumps({"seconds": sorted(times)[len(times) // 2], "blas": blas}))
"""


def numpy_gemm(n: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    out = subprocess.run([sys.executable, "-c", NUMPY_PEER, str(n), str(THREADS)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def matmul_model(n: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weight = helper.make_tensor("w", TensorProto.FLOAT, [n, n], rng.random((n, n)).ravel().tolist())
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, n])], [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def gemm_table(sizes: list[int]) -> list[str]:
    rows, peak = [], 0.0
    results = []
    for n in sizes:
        peer = numpy_gemm(n)
        model = gimlet_tvm.build(matmul_model(n), "llvm")
        x = np.random.default_rng(1).random((n, n), dtype=np.float32)
        ours = time_interleaved({"ours": lambda: model(x)}, repeat=max(5, int(2e9 / n**3)))
        flop = 2 * n**3
        results.append((n, flop / peer["seconds"] / 1e9, flop / (ours["ours"].median_ms / 1e3) / 1e9, peer))
        peak = max(peak, results[-1][1])
    rows.append(f"| n | numpy/OpenBLAS GFLOP/s | % of peak | gimlet_tvm GFLOP/s | % of peak |")
    rows.append("|---|---|---|---|---|")
    for n, theirs, ours, _ in results:
        rows.append(f"| {n} | {theirs:.1f} | {100 * theirs / peak:.0f}% | {ours:.1f} | "
                    f"{100 * ours / peak:.0f}% |")
    rows.append(f"\nPeak = best numpy GFLOP/s measured ({peak:.1f}). numpy BLAS: "
                f"{'; '.join(results[-1][3]['blas'])}. gimlet_tvm times include input/output copies.")
    return rows


def model_rows(names: list[str], trials: int, records: str) -> list[str]:
    rows = ["| model | trials | tuning time | tuned kernels | untuned / ORT | tuned / ORT | tuned / untuned |",
            "|---|---|---|---|---|---|---|"]
    for name in names:
        info, batch = SUITE[name], BATCH.get(name, 1)
        model = static_batch(info.build(), batch)
        inputs = info.example_inputs(batch)
        start = time.perf_counter()
        result = gimlet_tvm.tune(model, "llvm", os.path.join(records, name), trials=trials,
                                 log=sys.stderr)
        tuning = time.perf_counter() - start
        untuned = gimlet_tvm.build(model, "llvm")
        tuned = gimlet_tvm.build(model, "llvm", records=os.path.join(records, name))
        session = onnxruntime_session(model, THREADS)
        reference = session.run(None, inputs)
        for got, want in zip(tuned.run(inputs).values(), reference):
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
        times = time_interleaved({
            "untuned": lambda: untuned.run(inputs),
            "tuned": lambda: tuned.run(inputs),
            "ort": lambda: session.run(None, inputs),
        }, repeat=20)
        u, t, o = (times[k].median_ms for k in ("untuned", "tuned", "ort"))
        rows.append(f"| {name} (batch {batch}) | {result.trials_run} run, "
                    f"{sum(k.trials for k in result.tasks)} total | {tuning:.0f} s | "
                    f"{tuned.targets[0]['tuned_tasks']}/{len(result.tasks)} | {u / o:.2f} | "
                    f"{t / o:.2f} | {t / u:.2f} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(SUITE))
    parser.add_argument("--trials", type=int, default=64, help="total trials per model")
    parser.add_argument("--records", default=os.path.join(tempfile.gettempdir(), "gimlet-tuning"))
    parser.add_argument("--gemm-sizes", type=int, nargs="*", default=[256, 512, 1024, 2048])
    args = parser.parse_args()
    print("\n".join(gemm_table(args.gemm_sizes)), flush=True)
    print("\n".join(model_rows(args.models, args.trials, args.records)))


if __name__ == "__main__":
    main()
