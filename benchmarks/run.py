"""Benchmark gimlet_tvm against onnxruntime and IREE (llvm-cpu) on the model suite.

    .venv/bin/python benchmarks/run.py [--models mlp ...] [--repeat N] [--threads 2]
                                       [--out benchmarks/results.md]

Engine `ours_nodefaults` is gimlet_tvm built with `$GIMLET_TVM_DEFAULT_KERNELS=0` (the untuned
build before the targets' default kernels), to time both builds in one run. Engine
`ours_tuned` is gimlet_tvm built with the records in `--records DIR/<model>`; with
`--tune DURATION` each model is first tuned into them (`gimlet_tvm.tune` with that time
budget, kernel selection included; the tuning time is noted under the table):

    .venv/bin/python benchmarks/run.py --engines ours ours_tuned ort iree --records /tmp/rec --tune 10m

`--models` also takes models the suite does not contain, exported from torch
(`torch_models.py`: torch_resnet18, torch_resnet50, torch_mobilenetv2, torch_efficientnet_b0,
torch_mobilenet_v3, torch_squeezenet, torch_shufflenet_v2, torch_densenet121, torch_resnext50,
torch_convnext_tiny at 224x224, torch_bert and torch_gpt2 at 128 tokens, all batch 1); those run only when named.

Every engine gets the same model with its batch dimension fixed, the same inputs and the
same thread count. Outputs are checked against onnxruntime before timing; an engine that
fails to compile or disagrees is left out of that model's timing, with the reason noted.
Timed runs are interleaved round by round (ours, onnxruntime, IREE, ours, ...) after a
warm-up, so slow drifts of the machine hit every engine alike.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import functools
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_models import TORCH_MODELS  # noqa: E402  (benchmarks/ is not a package)

# gimlet_tvm (and so TVM) is imported only after main() has pinned the thread counts.
if TYPE_CHECKING:
    from gimlet_tvm.runtime import BenchmarkResult

Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]
Builder = Callable[[str, onnx.ModelProto, Path], Runner]  # (model name, model, work directory)

# Batch used for each model; models not listed run at batch 1.
BATCH = {"mlp": 32, "resnet_cnn": 8, "mobilenet_cnn": 8, "transformer_encoder": 8}
DEFAULT_ENGINES = ("ours", "ort", "iree")
ENGINES = (*DEFAULT_ENGINES, "ours_nodefaults", "ours_tuned")
OUR_BUILDS = ("ours", "ours_nodefaults", "ours_tuned")  # the rest are peers
LABEL = {"ours": "gimlet_tvm", "ort": "onnxruntime", "iree": "IREE llvm-cpu",
         "ours_nodefaults": "gimlet_tvm without default kernels", "ours_tuned": "gimlet_tvm tuned"}
RATIO_LABEL = {"ours": "ours", "ours_nodefaults": "no defaults", "ours_tuned": "tuned"}
DEFAULT_KERNELS_ENV = "GIMLET_TVM_DEFAULT_KERNELS"  # gimlet_tvm's, read at build time
VENV_BIN = Path(sys.executable).parent
IREE_FLAGS = [
    "--iree-hal-target-device=local",
    "--iree-hal-local-target-device-backends=llvm-cpu",
    "--iree-llvmcpu-target-cpu=host",
    "--iree-opt-data-tiling",
]


@dataclass
class EngineResult:
    """One engine on one model: compile time, latency, or why it has none."""

    compile_s: float | None = None
    latency: BenchmarkResult | None = None
    error: str | None = None


def static_batch(model: onnx.ModelProto, batch: int) -> onnx.ModelProto:
    """A copy of ``model`` whose symbolic batch dimension is fixed to ``batch``."""
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for value in [*fixed.graph.input, *fixed.graph.output]:
        value.type.tensor_type.shape.dim[0].dim_value = batch
    return fixed


def build_ours(model: onnx.ModelProto, records: Path | None = None) -> Runner:
    """gimlet_tvm.build for the llvm target (with the tuning `records`, if given)."""
    import gimlet_tvm

    compiled = gimlet_tvm.build(model, "llvm", records=str(records) if records else None)
    return lambda inputs: compiled(*inputs.values())


def build_ours_without_defaults(model: onnx.ModelProto) -> Runner:
    """gimlet_tvm.build with `$GIMLET_TVM_DEFAULT_KERNELS=0`: no target's default kernels
    (every layer on the library, as untuned builds ran before issue #26's defaults)."""
    previous = os.environ.get(DEFAULT_KERNELS_ENV)
    os.environ[DEFAULT_KERNELS_ENV] = "0"
    try:
        return build_ours(model)
    finally:
        if previous is None:
            del os.environ[DEFAULT_KERNELS_ENV]
        else:
            os.environ[DEFAULT_KERNELS_ENV] = previous


def build_ort(model: onnx.ModelProto, threads: int) -> Runner:
    """onnxruntime CPU EP, all graph optimisations, workers spinning as by default."""
    from gimlet_tvm.peers import onnxruntime_session

    session = onnxruntime_session(model, threads)
    return lambda inputs: session.run(None, inputs)


def _iree_tool(args: list[str]) -> None:
    """Run an IREE command-line tool; raise with the tail of its stderr on failure."""
    proc = subprocess.run([str(VENV_BIN / args[0]), *args[1:]], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])[:300]
        raise RuntimeError(f"{args[0]} failed: {tail}")


def build_iree(model: onnx.ModelProto, workdir: Path, config: object) -> Runner:
    """iree-import-onnx, then iree-compile for llvm-cpu tuned to the host CPU."""
    import iree.runtime as rt

    onnx_path, mlir_path, vmfb_path = (workdir / f"model.{e}" for e in ("onnx", "mlir", "vmfb"))
    onnx.save(model, onnx_path)
    _iree_tool(["iree-import-onnx", str(onnx_path), "-o", str(mlir_path)])
    _iree_tool(["iree-compile", str(mlir_path), "-o", str(vmfb_path), *IREE_FLAGS])
    vm_module = rt.VmModule.copy_buffer(config.vm_instance, vmfb_path.read_bytes())
    module = rt.load_vm_module(vm_module, config)
    entry = module[model.graph.name]

    def run(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        outputs = entry(*inputs.values())
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return [o.to_host() for o in outputs]

    return run


def mismatch(outputs: list[np.ndarray], reference: list[np.ndarray]) -> str | None:
    """None when ``outputs`` match onnxruntime's within fp32 tolerance, else why not."""
    from gimlet_tvm.peers import max_abs_diff

    if len(outputs) != len(reference):
        return f"{len(outputs)} outputs, expected {len(reference)}"
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        if out.shape != ref.shape:
            return f"output {i} shape {out.shape}, expected {ref.shape}"
        err = max_abs_diff([out], [ref]) / (float(np.abs(ref).max()) or 1.0)
        if not err <= 1e-3:
            return f"output {i} differs from onnxruntime (max error {err:.1e} of max |ref|)"
    return None


def tune_ours(name: str, records: Path, budget: str) -> float:
    """Tune model `name` into `records/<name>` within `budget`; the seconds it took."""
    import gimlet_tvm

    _, model, _ = model_and_inputs(name)
    print(f"[bench] tuning {name} for at most {budget} ...", file=sys.stderr, flush=True)
    return gimlet_tvm.tune(model, "llvm", str(records / name), time_budget=budget).seconds


def make_builders(engines: list[str], threads: int, records: Path | None) -> dict[str, Builder]:
    """Builders for the chosen engines, all limited to ``threads`` worker threads."""
    builders: dict[str, Builder] = {
        "ours": lambda name, model, workdir: build_ours(model),
        "ours_nodefaults": lambda name, model, workdir: build_ours_without_defaults(model),
        "ours_tuned": lambda name, model, workdir: build_ours(model, records / name),
        "ort": lambda name, model, workdir: build_ort(model, threads),
    }
    if "iree" in engines:
        import iree.runtime as rt

        # Flags must be parsed before the local-task driver starts its workers.
        rt.flags.parse_flags(f"--task_topology_max_group_count={threads}")
        config = rt.Config("local-task")
        builders["iree"] = lambda name, model, workdir: build_iree(model, workdir, config)
    return {e: builders[e] for e in engines}


def bench_model(
    name: str, builders: dict[str, Builder], repeat: int | None, budget_s: float
) -> tuple[int, dict[str, EngineResult]]:
    """Compile ``name`` with each engine, check outputs, then time interleaved rounds."""
    import onnxruntime as ort

    from gimlet_tvm.peers import time_interleaved

    batch, model, inputs = model_and_inputs(name)
    reference = ort.InferenceSession(model.SerializeToString()).run(None, inputs)
    results = {e: EngineResult() for e in builders}
    runners: dict[str, Runner] = {}
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        for engine, build in builders.items():
            workdir = Path(tmp) / engine
            workdir.mkdir()
            start = time.perf_counter()
            try:
                runners[engine] = build(name, model, workdir)
            except Exception as exc:  # noqa: BLE001 - any failure is a result to report
                traceback.print_exc()
                results[engine].error = f"compile failed: {_brief(exc)}"
                continue
            results[engine].compile_s = time.perf_counter() - start

        for engine in list(runners):
            try:
                problem = mismatch(runners[engine](inputs), reference)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                problem = f"run failed: {_brief(exc)}"
            if problem:
                results[engine].error = problem
                del runners[engine]

        if not runners:
            return batch, results
        # Warm-up (three runs, or one for slow engines) also sizes the number of rounds.
        warm = {e: _warm_up(run, inputs) for e, run in runners.items()}
        rounds = repeat or int(np.clip(budget_s / sum(warm.values()), 3, 100))
        calls = {e: functools.partial(run, inputs) for e, run in runners.items()}
        for engine, latency in time_interleaved(calls, repeat=rounds, warmup=0).items():
            results[engine].latency = latency
    return batch, results


def model_and_inputs(name: str) -> tuple[int, onnx.ModelProto, dict[str, np.ndarray]]:
    """Batch, model with its batch fixed, and seeded inputs of a suite or torch-exported model."""
    from gimlet_tvm.models import SUITE

    if name in SUITE:
        batch = BATCH.get(name, 1)
        return batch, static_batch(SUITE[name].build(), batch), SUITE[name].example_inputs(batch, seed=0)
    exported = TORCH_MODELS[name]
    return exported.input_shape[0], exported.onnx(), exported.example_inputs(seed=0)


def _brief(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _warm_up(run: Runner, inputs: dict[str, np.ndarray]) -> float:
    """Run up to three times, stopping after one second; return the fastest time."""
    times = [_timed(run, inputs)]
    while len(times) < 3 and sum(times) < 1.0:
        times.append(_timed(run, inputs))
    return min(times)


def _timed(run: Runner, inputs: dict[str, np.ndarray]) -> float:
    start = time.perf_counter()
    run(inputs)
    return time.perf_counter() - start


def _ms(result: EngineResult) -> str:
    if result.latency is None:
        return "—"
    lat = result.latency
    return f"{lat.median_ms:.2f} ({lat.p10_ms:.2f}–{lat.p90_ms:.2f})"


def _ratio(ours: EngineResult, peer: EngineResult) -> str:
    if ours.latency is None or peer.latency is None:
        return "—"
    return f"{ours.latency.median_ms / peer.latency.median_ms:.2f}"


def ratio_pairs(engines: list[str]) -> list[tuple[str, str]]:
    """The (numerator, denominator) engine pairs the report gives ratios for: each of our
    builds against each peer, and our other builds against the default one."""
    ours = [e for e in engines if e in OUR_BUILDS]
    pairs = [(o, e) for o in ours for e in engines if e not in OUR_BUILDS]
    return pairs + [(o, "ours") for o in ours if o != "ours" and "ours" in engines]


def report(
    rows: list[tuple[str, int, dict[str, EngineResult]]], engines: list[str], threads: int,
    tuning: dict[str, tuple[str, float]],
) -> str:
    """The Markdown report: a header naming machine and versions, then one row per model;
    `tuning`: model -> (time budget, seconds its tuning took) for the models tuned in this run."""
    from gimlet_tvm.peers import SETTLE_SECONDS

    pairs = ratio_pairs(engines)
    header = ["model", "batch", *(f"{LABEL[e]} ms" for e in engines)]
    header += [f"{RATIO_LABEL[a]}/{RATIO_LABEL.get(b, LABEL[b])}" for a, b in pairs]
    header += ["compile s (" + " / ".join(LABEL[e] for e in engines) + ")"]
    lines = [
        f"Date: {datetime.date.today().isoformat()}. Machine: {_cpu_name()}, "
        f"{os.cpu_count()} logical cores, {platform.system()} {platform.machine()}. "
        f"Threads: {threads} per engine, spinning as by default, interleaved rounds (each engine "
        f"settling at least 3 calls and {SETTLE_SECONDS * 1e3:.0f} ms before its timed one) after warm-up. "
        f"Load average at the end: {os.getloadavg()[0]:.2f}.",
        f"Versions: {_versions()}.",
        "Times: median (p10–p90) in ms over the timed rounds; a ratio below 1 means "
        "gimlet_tvm is faster.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    notes = []
    for name, batch, results in rows:
        cells = [name, str(batch), *(_ms(results[e]) for e in engines)]
        cells += [_ratio(results[a], results[b]) for a, b in pairs]
        cells.append(" / ".join(
            f"{results[e].compile_s:.1f}" if results[e].compile_s is not None else "—"
            for e in engines
        ))
        lines.append("| " + " | ".join(cells) + " |")
        rounds = max((r.latency.runs for r in results.values() if r.latency), default=0)
        notes.append(f"- {name}: {rounds} timed rounds." + (
            f" Tuned in {tuning[name][1]:.0f} s (time budget {tuning[name][0]})." if name in tuning else ""))
        notes += [f"- {name}, {LABEL[e]}: {r.error}" for e, r in results.items() if r.error]
    return "\n".join([*lines, "", *notes]) + "\n"


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for pkg in ("gimlet-tvm", "apache-tvm", "onnxruntime", "iree-base-compiler"):
        try:
            parts.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            parts.append(f"{pkg} not installed")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, pin thread counts, run every model, print and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+",
                        help=f"suite names (default: all) or torch-exported ones: {', '.join(TORCH_MODELS)}")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(DEFAULT_ENGINES))
    parser.add_argument("--repeat", type=int, help="timed rounds (default: fit --budget)")
    parser.add_argument("--budget", type=float, default=15.0,
                        help="seconds of timed rounds per model when --repeat is not given")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results.md")
    parser.add_argument("--records", type=Path, metavar="DIR",
                        help="engine ours_tuned builds with the tuning records in DIR/<model>")
    parser.add_argument("--tune", metavar="DURATION",
                        help="first tune each model into --records within this time budget (10m)")
    args = parser.parse_args(argv)
    if ("ours_tuned" in args.engines or args.tune) and args.records is None:
        parser.error("engine ours_tuned and --tune need --records DIR")

    # Thread pools read these when they start, so set them before any engine is imported.
    for var in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    from gimlet_tvm.models import SUITE
    from gimlet_tvm.runtime.libraries import load_available

    # Our runtime libraries build on first use after a source change (about 30 s): build them
    # now, so the first model's compile time is its own.
    load_available()
    names = args.models or list(SUITE)
    unknown = sorted(set(names) - set(SUITE) - set(TORCH_MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; the suite has {list(SUITE)}, "
                     f"torch_models {list(TORCH_MODELS)}")
    tuning = {name: (args.tune, tune_ours(name, args.records, args.tune)) for name in names} if args.tune else {}
    builders = make_builders(args.engines, args.threads, args.records)
    rows = []
    for name in names:
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        batch, results = bench_model(name, builders, args.repeat, args.budget)
        rows.append((name, batch, results))
    table = report(rows, args.engines, args.threads, tuning)
    print(table)
    args.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
