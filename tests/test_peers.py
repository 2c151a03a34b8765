"""Interleaved timing shared by `bench` and benchmarks/: the order engines run in, and the
per-round ratio between two of them."""

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
    assert str(ratio) == "0.83 [0.83-0.84]"
