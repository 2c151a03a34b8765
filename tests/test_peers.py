"""Interleaved timing shared by `bench` and benchmarks/: the order engines run in, and the
per-round ratio between two of them."""

import pytest

from gimlet_tvm.peers import PairedRatio, time_interleaved
from gimlet_tvm.runtime import BenchmarkResult


def test_each_round_starts_one_engine_further_on():
    ran: list[str] = []
    engines = {name: (lambda n=name: ran.append(n)) for name in "abc"}
    times = time_interleaved(engines, repeat=4, warmup=1)
    assert ran == list("abc" + "abc" + "bca" + "cab" + "abc")
    assert all(result.runs == 4 and len(result.samples_ms) == 4 for result in times.values())


def test_paired_ratio_pairs_the_runs_of_one_round():
    # A slow phase (round 3) slows both engines: each one's own spread is wide, but the
    # first is faster than the second in every round.
    first = BenchmarkResult.from_samples([0.010, 0.011, 0.030, 0.010])
    second = BenchmarkResult.from_samples([0.012, 0.013, 0.036, 0.012])
    ratio = PairedRatio.of(first, second)
    assert first.p90_ms > second.median_ms
    assert str(ratio) == "0.83 [0.83-0.84] (median 0.83-0.85)"


def test_median_interval_narrows_with_rounds():
    # Ratios 0.80, 0.81, ..., 1.19 in 40 rounds, then the same spread in 400: the median's
    # interval (order statistics 20 +- 1.96 sqrt(40)/2) shrinks, the p10-p90 spread does not.
    def ratio(rounds: int) -> PairedRatio:
        steps = [0.8 + 0.4 * (i % 40) / 40 for i in range(rounds)]
        return PairedRatio.of(BenchmarkResult.from_samples(steps), BenchmarkResult.from_samples([1.0] * rounds))
    few, many = ratio(40), ratio(400)
    assert (few.median_low, few.median_high) == pytest.approx((0.93, 1.06))
    assert round(few.p10, 2) == round(many.p10, 2) and round(few.p90, 2) == round(many.p90, 2)
    assert few.median_low < many.median_low <= many.median <= many.median_high < few.median_high
