"""The fuzzer (`tests/fuzz.py`) in CI: every saved finding replayed, and a few rounds of every
mutator of every stage with a fixed seed; each must end in a typed error or a correct result.
`python -m tests.fuzz --minutes 60` is the longer run."""

from __future__ import annotations

import os
import signal

import pytest

from . import fuzz

CORPUS = fuzz.corpus_cases(fuzz.CORPUS)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """A fuzz worker with the seed material (artifacts, records) prepared once."""
    worker = fuzz.Worker(str(tmp_path_factory.mktemp("fuzz")))
    paths = worker.prepare()
    yield worker, paths
    worker.close()


def test_corpus_holds_findings_of_every_stage_it_names():
    assert CORPUS, f"no cases in {fuzz.CORPUS}"
    assert {case.stage for case in CORPUS} <= set(fuzz.MUTATORS)


@pytest.mark.parametrize("case", CORPUS, ids=[f"{c.stage}-{c.mutator}-{c.digest()[:8]}" for c in CORPUS])
def test_corpus_case_ends_typed_or_correct(worker, case):
    outcome = worker[0].run(case)
    assert not outcome.finding, f"{outcome.status}: {outcome.detail}"


ROUNDS = 3
"""Rounds CI runs: each mutator meets three seed models (the three took 12 s here)."""


def test_rounds_of_every_mutator_find_nothing(worker):
    seeds = fuzz.seed_payloads(worker[1])
    cases = [case for index in range(ROUNDS) for case in fuzz.round_cases(seeds, index, master_seed=0)]
    ran = {(case.stage, case.mutator) for case in cases}
    every = {(stage, name) for stage, mutators in fuzz.MUTATORS.items() for name in mutators}
    assert every - ran <= {(stage, name) for stage, name, _ in fuzz.KNOWN}, every - ran
    report = fuzz.run_cases(cases, worker[0])
    assert report.outcomes.get("typed") and report.outcomes.get("ok"), report.summary()
    assert not report.findings, "\n".join(
        f"{c.stage}/{c.mutator} on {c.seed}: {o.status}: {o.detail}" for c, o in report.findings)


def test_a_worker_that_dies_is_a_crash_and_one_that_is_silent_a_hang(tmp_path):
    case = CORPUS[0]
    dying = fuzz.Worker(str(tmp_path))
    dying._start()
    os.kill(dying._process.pid, signal.SIGSEGV)
    dying._process.join(30)
    outcome = dying.run(case)
    assert outcome.status == "crash" and "signal 11" in outcome.detail, outcome
    silent = fuzz.Worker(str(tmp_path), timeout=0.01)  # it cannot even import in that time
    try:
        outcome = silent.run(case)
        assert outcome.status == "hang", outcome
    finally:
        silent.close()
