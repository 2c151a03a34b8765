"""Kernel selection (issue #8): end-to-end latency of the selected kernels vs
"generated only" and "library only" (each op group's best verified candidate of that source),
each as a ratio against onnxruntime timed in the same run, interleaved. Input shapes are fixed
(the suite's example inputs at `--batch`). Prints each op group's winner, then one table row:
median ms [p10-p90] (median / onnxruntime median), and selected's time over each single-source
build's within the same round (median [p10-p90] of those per-round ratios, and the 95%
confidence interval of that median). The last ratio is the floor: generated only built a second
time over the first build, the same kernels (two builds of the same code were seen 3-6% apart).
`--generator CMD` (a kernel generator, e.g. `search`: docs/kernel-generators.md) adds its
kernels to the candidates, and a "generator only" build (each op group's best verified kernel
of the generator's, the default elsewhere). `--target cuda` selects among CUDA candidates (generated, hand-written, cuBLAS) on the GPU;
onnxruntime still runs on the CPU there (this build has no CUDA provider), so the ratios that
count are those against the single-source builds.

    python benchmarks/kernel_selection.py [--models mlp bert_base_like] [--batch 1] [--repeat 10]
        [--tune-trials N] [--records DIR] [--target llvm] [--generator CMD [--generator-rounds N]]
"""

from __future__ import annotations

import argparse
import collections
import tempfile

import gimlet_tvm
from gimlet_tvm.compiler import resolve_target
from gimlet_tvm.frontend import import_model
from gimlet_tvm.models import SUITE
from gimlet_tvm.peers import PairedRatio, check_against_onnxruntime, onnxruntime_session, time_interleaved
from gimlet_tvm.selection.generator import Generator
from gimlet_tvm.selection.select import select_kernels, selected_sources

MODELS = ["mlp", "bert_base_like"]


def measure(name: str, target_name: str, batch: int, repeat: int, threads: int, tune_trials: int,
            records: str | None, generator: Generator | None) -> str:
    if records:
        return _measure(name, target_name, batch, repeat, threads, tune_trials, records, generator)
    with tempfile.TemporaryDirectory() as scratch:
        return _measure(name, target_name, batch, repeat, threads, tune_trials, scratch, generator)


def _single_sources(generator: Generator | None) -> tuple[str, ...]:
    """The single-source builds timed beside the selection."""
    return ("generated", "library", *(("generator",) if generator else ()))


def _measure(name: str, target_name: str, batch: int, repeat: int, threads: int, tune_trials: int,
             records: str, generator: Generator | None) -> str:
    info = SUITE[name]
    proto = info.build()
    inputs = info.example_inputs(batch=batch)
    shapes = {key: list(value.shape) for key, value in inputs.items()}
    _, target = resolve_target(target_name)
    mod, _ = import_model(proto, shapes)
    if tune_trials:
        selection = gimlet_tvm.tune(proto, target_name, records, trials=tune_trials, input_shapes=shapes,
                                    tune_generated=True).selection
    else:
        selection = select_kernels(mod, target, records=records, timeout=300, min_repeat_ms=10, generator=generator,
                                   progress=lambda line: print(f"  {name}: {line}", flush=True))
    for key, choice in selection.choices.items():
        times = ", ".join(f"{t.id} {t.seconds * 1e3:.3f} ms" if t.verified else f"{t.id} no"
                          for t in choice.tried)
        print(f"  {name}: {key} (x{choice.count}) -> {choice.winner}: {times}", flush=True)
    sources = collections.Counter(selected_sources(selection))
    builds = {"selected": selection,
              **{f"{source} only": selection.restricted_to(source) for source in _single_sources(generator)},
              "generated only, rebuilt": selection.restricted_to("generated")}
    models = {label: gimlet_tvm.build(proto, target_name, input_shapes=shapes, records=records, selection=chosen)
              for label, chosen in builds.items()}
    for label, model in models.items():
        ok, diff = check_against_onnxruntime(proto, model, inputs, tolerance=1e-3)
        assert ok, f"{name} {label}: differs from onnxruntime by {diff}"
    session = onnxruntime_session(proto, threads)
    engines = {label: (lambda m=model: m(*inputs.values())) for label, model in models.items()}
    engines["onnxruntime"] = lambda: session.run(None, inputs)
    times = time_interleaved(engines, repeat=repeat, warmup=2)
    ort = times["onnxruntime"].median_ms
    cells = [f"{times[label].median_ms:.2f} [{times[label].p10_ms:.2f}-{times[label].p90_ms:.2f}] "
             f"({times[label].median_ms / ort:.2f})"
             for label in ("selected", *(f"{source} only" for source in _single_sources(generator)))]
    paired = [str(PairedRatio.of(times[first], times[second])) for first, second in (
        *(("selected", f"{source} only") for source in _single_sources(generator)),
        ("generated only, rebuilt", "generated only"))]
    mix = ", ".join(f"{n} {s}" for s, n in sorted(sources.items()))
    ort_cell = f"{ort:.2f} [{times['onnxruntime'].p10_ms:.2f}-{times['onnxruntime'].p90_ms:.2f}]"
    tuned = f", generated tuned ({tune_trials} trials)" if tune_trials else ""
    return f"| {name} (batch {batch}), repeat {repeat}{tuned} | {mix} | " + " | ".join(cells + paired) + f" | {ort_cell} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime threads")
    parser.add_argument("--target", default="llvm", help="a registered target name (llvm, cuda)")
    parser.add_argument("--tune-trials", type=int, default=0, metavar="N",
                        help="first `tune` with N trials and tune_generated (the generated "
                        "candidates then run tuned); default: select with default schedules")
    parser.add_argument("--records", metavar="DIR",
                        help="tuning records to use and keep (a run without --tune-trials then "
                        "selects over the generated code tuned there); default: a scratch folder")
    parser.add_argument("--generator", metavar="CMD",
                        help="a kernel generator's command or a bundled one's name (search, openai ...)")
    parser.add_argument("--generator-rounds", type=int, default=3, metavar="N")
    args = parser.parse_args()
    generator = Generator.named(args.generator, rounds=args.generator_rounds) if args.generator else None
    rows = [measure(name, args.target, args.batch, args.repeat, args.threads, args.tune_trials, args.records,
                    generator)
            for name in args.models]
    singles = _single_sources(generator)
    head = ["model", "selected sources (op groups)", "selected ms (/ORT)",
            *(f"{source} only ms (/ORT)" for source in singles),
            *(f"selected / {source} only" for source in singles),
            "generated only rebuilt / generated only (floor)", "onnxruntime ms"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
