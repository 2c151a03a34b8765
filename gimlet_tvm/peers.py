"""Peer engines we compare against, and interleaved timing shared by `bench` and benchmarks/."""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import numpy as np
import onnx

from .runtime import BenchmarkResult


def onnxruntime_session(model: onnx.ModelProto, threads: int):
    """An onnxruntime CPU session with all graph optimizations and `threads` threads.

    Spinning is off: with interleaved runs on few cores, spinning workers slow both engines.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def time_interleaved(
    engines: Mapping[str, Callable[[], object]], *, repeat: int, warmup: int = 3
) -> dict[str, BenchmarkResult]:
    """Time each engine's call `repeat` times, alternating engines within each round.

    Interleaving spreads any slow phase of the machine over all engines alike.
    """
    for _ in range(warmup):
        for call in engines.values():
            call()
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeat):
        for name, call in engines.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    return {name: BenchmarkResult.from_samples(s) for name, s in samples.items()}


def max_abs_diff(ours: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """Largest absolute difference over all outputs (inf where shapes differ)."""
    worst = 0.0
    for a, b in zip(ours, reference):
        if a.shape != b.shape:
            return float("inf")
        if a.size:
            worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))))
    return worst


def check_against_onnxruntime(
    proto: onnx.ModelProto, run: Callable[..., Sequence[np.ndarray]], inputs: Mapping[str, np.ndarray],
    tolerance: float = 1e-4,
) -> tuple[bool, float]:
    """Whether `run(*inputs)` matches onnxruntime within rtol = atol = `tolerance`, and the
    largest absolute difference."""
    reference = onnxruntime_session(proto, threads=1).run(None, dict(inputs))
    ours = run(*inputs.values())
    ok = len(ours) == len(reference) and all(
        o.shape == r.shape and np.allclose(o, r, rtol=tolerance, atol=tolerance)
        for o, r in zip(ours, reference))
    return ok, max_abs_diff(ours, reference)
