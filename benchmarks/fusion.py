"""Graph fusion off vs on (llvm): kernels launched per run and latency, per suite model.

Both builds of a model are timed in the same process, interleaved in rounds, so drift on the
machine hits both alike. Writes benchmarks/fusion.md.

    python benchmarks/fusion.py [--models transformer_encoder mlp] [--rounds 5] [--repeat 20]
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import tvm

import gimlet_tvm
from gimlet_tvm.compiler import fusion_passes, resolve_target
from gimlet_tvm.frontend import import_model
from gimlet_tvm.models import SUITE
from gimlet_tvm.relax_passes.graph_fusion import count_kernel_launches, graph_fusion_disabled
from gimlet_tvm.runtime import BenchmarkResult

MODELS = ["transformer_encoder", "resnet_cnn", "mobilenet_cnn", "mlp", "bert_base_like"]
RESULTS = Path(__file__).resolve().parent / "fusion.md"


def fusion_setting(enabled: bool) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if enabled else graph_fusion_disabled()


def kernel_launches(name: str, enabled: bool) -> int:
    spec, target = resolve_target("llvm")
    mod, _ = import_model(SUITE[name].build(), None)
    with target, fusion_setting(enabled):
        return count_kernel_launches(tvm.transform.Sequential(fusion_passes(spec, target))(mod))


def measure(name: str, rounds: int, repeat: int) -> dict[bool, tuple[int, BenchmarkResult]]:
    """Kernel count and latency (batch 1) of the model built with fusion off and on."""
    proto = SUITE[name].build()
    inputs = SUITE[name].example_inputs(batch=1)
    models = {}
    for enabled in (False, True):
        with fusion_setting(enabled):
            models[enabled] = gimlet_tvm.build(proto, "llvm")
    samples: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for enabled, model in models.items():
            result = model.benchmark(inputs, repeat=repeat, warmup=2)
            samples[enabled].append(result.median_ms / 1e3)
    return {
        enabled: (kernel_launches(name, enabled), BenchmarkResult.from_samples(samples[enabled]))
        for enabled in models
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per build")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per round")
    args = parser.parse_args()
    lines = [
        "# Graph fusion off vs on (llvm, batch 1)",
        "",
        f"Medians of {args.rounds} interleaved rounds of {args.repeat} runs each; p10/p90 over "
        "the rounds' medians. Kernels: `call_tir` + library calls launched per run.",
        "",
        "| model | kernels off | kernels on | median off (ms) | median on (ms) | p10/p90 off | "
        "p10/p90 on | speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in args.models:
        (k_off, off), (k_on, on) = measure(name, args.rounds, args.repeat).values()
        line = (
            f"| {name} | {k_off} | {k_on} | {off.median_ms:.3f} | {on.median_ms:.3f} | "
            f"{off.p10_ms:.3f}/{off.p90_ms:.3f} | {on.p10_ms:.3f}/{on.p90_ms:.3f} | "
            f"{off.median_ms / on.median_ms:.2f}x |"
        )
        print(line, flush=True)
        lines.append(line)
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
