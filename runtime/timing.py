"""Latency statistics of repeated runs, local or remote."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class BenchmarkResult:
    """Latency of repeated runs, in milliseconds; `samples_ms` in the order they ran."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    max_ms: float
    runs: int
    samples_ms: tuple[float, ...] = dataclasses.field(default=(), repr=False, compare=False)

    @classmethod
    def from_samples(cls, seconds: Sequence[float]) -> "BenchmarkResult":
        in_order = tuple(s * 1e3 for s in seconds)
        ms = sorted(in_order)
        deciles = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else [ms[0]] * 9
        return cls(statistics.median(ms), deciles[0], deciles[-1], ms[0], ms[-1], len(ms), in_order)

    def __str__(self) -> str:
        return (
            f"median {self.median_ms:.3f} ms (p10 {self.p10_ms:.3f}, p90 {self.p90_ms:.3f}, "
            f"{self.runs} runs)"
        )
