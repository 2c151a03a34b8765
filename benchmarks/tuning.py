"""Tuning benchmark: untuned vs tuned gimlet_tvm vs onnxruntime, and a GEMM table.

    .venv/bin/python benchmarks/tuning.py                        # whole suite, 64 trials a model
    .venv/bin/python benchmarks/tuning.py --models mlp --trials 32 --gemm-sizes 512

Models: each suite model at the batch benchmarks/run.py uses, tuned into
`--records/<model>` with `gimlet_tvm.tune` (MetaSchedule over the TIR kernels, then kernel
selection over each matmul group's candidates; resumable: a rerun reuses the records), then
built untuned and tuned and timed against onnxruntime in interleaved rounds (`--threads`,
`gimlet_tvm.peers.time_interleaved`). Reported as ratios of medians (below 1: faster than
onnxruntime) with the trial budget, the tuning time and the kernels selection chose.

GEMM: C = A @ W in fp32, square sizes, W a weight. numpy/OpenBLAS runs in its own process
with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset (they can slow OpenBLAS on this machine)
and reports the kernel threadpoolctl sees. Ours: a MatMul ONNX model through gimlet_tvm.build,
untuned (dispatched to OpenBLAS on the CPU) and tuned (the kernel selection chose). Peak: the
best GFLOP/s measured on this machine in the run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

THREADS = int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 2
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


def _selected(selection) -> str:
    """`2 handwritten:cpu_gemm_packed_tallx2v, 1 library:openblas`: the selection's winners."""
    counts = collections.Counter(c.winner for c in selection.choices.values() if c.winner) if selection else {}
    return ", ".join(f"{n} {w}" for w, n in sorted(counts.items())) or "-"


def gemm_table(sizes: list[int], records: str) -> list[str]:
    results, peak = [], 0.0
    for n in sizes:
        peer = numpy_gemm(n)
        model = matmul_model(n)
        tune = gimlet_tvm.tune(model, "llvm", os.path.join(records, f"gemm{n}"), trials=1, log=sys.stderr)
        untuned = gimlet_tvm.build(model, "llvm")
        tuned = gimlet_tvm.build(model, "llvm", records=os.path.join(records, f"gemm{n}"))
        x = np.random.default_rng(1).random((n, n), dtype=np.float32)
        np.testing.assert_allclose(tuned(x)[0], untuned(x)[0], rtol=1e-3, atol=1e-3)
        times = time_interleaved({"untuned": lambda: untuned(x), "tuned": lambda: tuned(x)},
                                 repeat=max(5, int(2e9 / n**3)))
        gflops = [2 * n**3 / seconds / 1e9 for seconds in
                  (peer["seconds"], times["untuned"].median_ms / 1e3, times["tuned"].median_ms / 1e3)]
        results.append((n, gflops, _selected(tune.selection), peer["blas"]))
        peak = max(peak, *gflops)
    rows = ["| n | numpy/OpenBLAS GFLOP/s (% of peak) | untuned GFLOP/s (% of peak) | "
            "tuned GFLOP/s (% of peak) | tuned kernel |", "|---|---|---|---|---|"]
    for n, gflops, selected, _ in results:
        cells = " | ".join(f"{g:.1f} ({100 * g / peak:.0f}%)" for g in gflops)
        rows.append(f"| {n} | {cells} | {selected} |")
    rows.append(f"\nPeak = best GFLOP/s measured in this run ({peak:.1f}). numpy BLAS: "
                f"{'; '.join(results[-1][3])}. gimlet_tvm times include input/output copies.")
    return rows


def model_rows(names: list[str], trials: int, records: str) -> list[str]:
    rows = ["| model | trials (this run, total) | tuning time | tuned kernels | selected kernels | "
            "untuned / ORT | tuned / ORT | tuned / untuned | ms untuned, tuned, ORT (p10-p90) |",
            "|---|---|---|---|---|---|---|---|---|"]
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
        spread = ", ".join(f"{times[k].median_ms:.2f} ({times[k].p10_ms:.2f}-{times[k].p90_ms:.2f})"
                           for k in ("untuned", "tuned", "ort"))
        rows.append(f"| {name} (batch {batch}) | {result.trials_run}, "
                    f"{sum(k.trials for k in result.tasks)} | {tuning:.0f} s | "
                    f"{tuned.targets[0]['tuned_tasks']}/{len(result.tasks)} | {_selected(result.selection)} | "
                    f"{u / o:.2f} | {t / o:.2f} | {t / u:.2f} | {spread} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(SUITE))
    parser.add_argument("--trials", type=int, default=64, help="total trials per model")
    parser.add_argument("--records", default=os.path.join(tempfile.gettempdir(), "gimlet-tuning"))
    parser.add_argument("--gemm-sizes", type=int, nargs="*", default=[256, 512, 1024])
    parser.add_argument("--threads", type=int, default=2, help="threads of every engine")
    args = parser.parse_args()
    print(f"{THREADS} threads per engine; load average at the start: {os.getloadavg()}", flush=True)
    if args.gemm_sizes:
        print("\n".join(gemm_table(args.gemm_sizes, args.records)), flush=True)
    print("\n".join(model_rows(args.models, args.trials, args.records)))


if __name__ == "__main__":
    main()
