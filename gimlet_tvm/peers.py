"""Peer engines we compare against, and interleaved timing shared by `bench` and benchmarks/."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Iterator, Mapping, Sequence, TypeVar

import numpy as np
import onnx

from .runtime import BenchmarkResult

T = TypeVar("T")
SETTLE_SECONDS = 0.02  # `time_interleaved`: each engine's untimed calls before its timed one


def onnxruntime_session(model: onnx.ModelProto, threads: int):
    """An onnxruntime CPU session with all graph optimizations and `threads` threads, its
    workers spinning between calls as by default (with spinning off it ran up to 2x slower on
    two cores; `time_interleaved` lets each engine settle instead)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def balanced_orders(count: int) -> list[list[int]]:
    """Orders of `count` items (a Williams design): each order holds every item once, and over
    all of them every item runs right after every other equally often (once for an even count,
    twice for an odd one). Timing engines in these orders, round after round, spreads whatever
    one engine leaves behind (its threads winding down, its cache traffic) over all the others
    alike; rotating one fixed order does not, since it keeps each engine's predecessor fixed."""
    first = [0]
    for step in range(1, count):
        first.append((step + 1) // 2 if step % 2 else count - step // 2)
    orders = [[(item + shift) % count for item in first] for shift in range(count)]
    return orders + [order[::-1] for order in orders] if count % 2 else orders


def interleaved(items: Sequence[T], rounds: int) -> Iterator[T]:
    """`items`, `rounds` times over, each round in the next of the `balanced_orders`."""
    orders = balanced_orders(len(items))
    for round_index in range(rounds):
        for index in orders[round_index % len(orders)]:
            yield items[index]


def time_interleaved(
    engines: Mapping[str, Callable[[], object]], *, repeat: int, warmup: int = 3, settle: int = 3,
    settle_s: float = SETTLE_SECONDS,
) -> dict[str, BenchmarkResult]:
    """Time each engine's call `repeat` times, alternating engines within each round.

    Interleaving spreads any slow phase of the machine over all engines alike; the rounds go
    through `balanced_orders`, so that each engine runs right after each other one equally often.
    In its turn each engine first runs untimed calls, at least `settle` of them and for at least
    `settle_s` seconds, so that the timed call finds the machine as a loop of that engine's
    inferences leaves it, not as another engine left it: onnxruntime's, OpenBLAS's and TVM's
    workers spin a while after a call, and on two cores the next engine then ran up to 2x
    slower (one settling call was not enough, three were for models of several milliseconds;
    sub-millisecond ones need the time floor).
    """
    for _ in range(warmup):
        for call in engines.values():
            call()
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for name in interleaved(list(engines), repeat):
        settled, until = 0, time.perf_counter() + settle_s
        while settled < settle or time.perf_counter() < until:
            engines[name]()
            settled += 1
        start = time.perf_counter()
        engines[name]()
        samples[name].append(time.perf_counter() - start)
    return {name: BenchmarkResult.from_samples(s) for name, s in samples.items()}


@dataclasses.dataclass(frozen=True)
class PairedRatio:
    """Per-round ratio of two engines timed by `time_interleaved`: median, p10-p90, and a 95%
    confidence interval of the median (distribution-free: order statistics around n/2).
    Pairing the runs of one round cancels the machine's slow phases, which widen each
    engine's own spread; an interval below 1 says the first engine is the faster one."""

    median: float
    p10: float
    p90: float
    median_low: float
    median_high: float

    @classmethod
    def of(cls, first: BenchmarkResult, second: BenchmarkResult) -> "PairedRatio":
        return cls.of_rounds(first.samples_ms, second.samples_ms)

    @classmethod
    def of_rounds(cls, first: Sequence[float], second: Sequence[float]) -> "PairedRatio":
        """The ratio of two engines' times given round by round."""
        ratios = sorted(a / b for a, b in zip(first, second, strict=True))
        n = len(ratios)
        deciles = statistics.quantiles(ratios, n=10, method="inclusive") if n > 1 else ratios * 9
        half_width = 0.98 * math.sqrt(n)  # 1.96 standard deviations of Binomial(n, 1/2)
        low = max(0, math.floor(n / 2 - half_width))
        high = min(n - 1, math.ceil(n / 2 + half_width) - 1)
        return cls(statistics.median(ratios), deciles[0], deciles[-1], ratios[low], ratios[high])

    def __str__(self) -> str:
        return (f"{self.median:.2f} [{self.p10:.2f}-{self.p90:.2f}] "
                f"(median {self.median_low:.2f}-{self.median_high:.2f})")


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
