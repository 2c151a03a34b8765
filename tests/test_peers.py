"""Interleaved timing shared by `bench` and benchmarks/: the order engines run in, and the
per-round ratio between two of them."""

import collections
import time

import pytest

from gimlet_tvm.peers import PairedRatio, balanced_orders, time_interleaved
from gimlet_tvm.runtime import BenchmarkResult


def test_rounds_go_through_balanced_orders():
    ran: list[str] = []
    engines = {name: (lambda n=name: ran.append(n)) for name in "abcd"}
    times = time_interleaved(engines, repeat=5, warmup=1, settle=0, settle_s=0)
    rounds = ["".join(ran[i:i + 4]) for i in range(0, len(ran), 4)]
    assert rounds == ["abcd", "abdc", "bcad", "cdba", "dacb", "abdc"]
    assert all(result.runs == 5 and len(result.samples_ms) == 5 for result in times.values())


def test_each_engine_settles_before_its_timed_call():
    ran: list[str] = []
    engines = {name: (lambda n=name: ran.append(n)) for name in "ab"}
    times = time_interleaved(engines, repeat=2, warmup=0, settle=2, settle_s=0)
    assert "".join(ran) == "aaabbb" + "bbbaaa"
    assert all(result.runs == 2 for result in times.values())


def test_settling_lasts_at_least_its_time_floor():
    """Fast calls settle for `settle_s` seconds, more than `settle` calls."""
    ran: list[str] = []
    engines = {name: (lambda n=name: (ran.append(n), time.sleep(0.001))) for name in "ab"}
    time_interleaved(engines, repeat=1, warmup=0, settle=1, settle_s=0.02)
    a_turn = ran[:ran.index("b")]
    assert 10 <= len(a_turn) and ran.count("b") == len(ran) - len(a_turn)


@pytest.mark.parametrize("count", [2, 3, 4, 5, 6, 7])
def test_balanced_orders_give_every_engine_every_predecessor_equally_often(count):
    orders = balanced_orders(count)
    assert all(sorted(order) == list(range(count)) for order in orders)
    pairs = collections.Counter(pair for order in orders for pair in zip(order, order[1:]))
    assert len(pairs) == count * (count - 1) and len(set(pairs.values())) == 1


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
