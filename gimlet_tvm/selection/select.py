"""Choosing each op's kernel by verified measurement: `select_kernels`.

`select_kernels` finds the model's op signatures (after graph fusion, op groups formed with
the epilogues the library would absorb: what the build's `ApplyKernelSelection` sees), lists
every source's candidates, verifies and times each in a subprocess (`verify.Verifier`: one child
per op group, serving its candidates in turn, a fresh one after a candidate that ended it),
times the ones within `RACE_WITHIN` times the fastest again side by side in one subprocess
(`verify.race_candidates`: rounds, each timing every one of them once) and picks the one with
the lowest median over those rounds, unless the race cannot tell it from others: among such
ties the first source in `SOURCE_PREFERENCE` wins, so that selecting again does not flip
between equals on a timing's noise. With a kernel `generator` (`generator.Generator`), each op
group it is offered gets its rounds after the other candidates, before the race. The result is a `KernelSelection`
(`schedules.kernel_selection.choices`: stored with every candidate's outcome, applied by
`build(records=DIR)`).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import statistics
import time
import warnings
from typing import Any, Callable, Iterable

import tvm
from tvm import relax

from ..compiler import canonicalize_passes
from ..errors import GimletError, RemoteDeviceError
from ..logs import quiet_tvm_logs
from ..peers import PairedRatio
from ..relax_passes.graph_fusion import graph_fusion_passes
from ..relax_passes.library_dispatch import layout_passes
from ..runtime.remote import RemoteDevice
from ..schedules.kernel_selection.apply import grouping_passes
from ..schedules.kernel_selection.candidates import OpSignature
from ..schedules.kernel_selection.choices import KernelSelection, OpChoice, Tried
from ..schedules.kernel_selection.sources import candidates
from ..schedules.tuning.records import RecordsDB, target_key
from ..targets import spec_for
from .generator import GENERATED_DIR, Generator, formats_for, generate
from .verify import Outcome, Verifier, race_candidates

# Verified candidates whose first timing is within this factor of the fastest are timed again
# together, in RACE_ROUNDS rounds: on a shared host one timing alone was seen 2.6x off.
RACE_WITHIN = 3.0
RACE_ROUNDS = 9
# Between candidates the race cannot tell apart (the 95% confidence interval of their per-round
# time ratio holds 1): the compiler's own code tuned for the shape, then kernels kept in this
# repository, then library calls (a runtime extension), then kernels from outside.
SOURCE_PREFERENCE = ("generated", "handwritten", "library", "external", "generator")
HOPELESS = 10.0       # generated code this many times slower than the fastest so far is timed once


def op_signatures(mod: tvm.IRModule, target: tvm.target.Target) -> dict[OpSignature, int]:
    """The signatures selection handles in `mod` (imported), with how often each occurs,
    as the build's `ApplyKernelSelection` sees them (after the target's layout passes, op groups
    formed)."""
    passes = [*canonicalize_passes(), *graph_fusion_passes(), *layout_passes(spec_for(target)),
              *grouping_passes(target)]
    with target:
        mod = tvm.transform.Sequential(passes)(mod)
    counts: dict[OpSignature, int] = {}

    def visit(expr: relax.Expr) -> None:
        sig = OpSignature.of_call(expr, mod)
        if sig is not None:
            counts[sig] = counts.get(sig, 0) + 1

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return counts


def _check_remote(remote: RemoteDevice, what: str) -> None:
    """After a remote step failed in `what`: the device must still answer (else selection
    stops with a `RemoteDeviceError`); then the candidate broke its session."""
    try:
        remote.connect()
    except RemoteDeviceError as err:
        raise RemoteDeviceError(f"{remote.describe()} was lost during kernel selection ({what}): {err}") from None
    finally:
        gc.collect()  # ends the probe's session (TVM's RPC objects form cycles)


def _run(verifier: Verifier, request: dict[str, Any], timeout: float, remote: RemoteDevice | None) -> Outcome:
    """`Verifier.run`, the remote device checked where a remote step failed."""
    outcome = verifier.run(request, timeout)
    if not outcome.remote_failed:
        return outcome
    _check_remote(remote, f"{request['candidate']} for {request['signature']['op']}")
    return Outcome(False, f"broke its remote session: {outcome.reason}", verdict="remote failure")


def _race_close(tried: list[Tried], request: dict[str, Any], timeout: float,
                remote: RemoteDevice | None = None) -> str | None:
    """Time the verified candidates within `RACE_WITHIN` times the fastest against each other
    (`race_candidates`, `RACE_ROUNDS` rounds); each then has the median of its rounds as its
    time. Returns why the race failed (the first timings then stand), or None."""
    verified = [t for t in tried if t.verified]
    best = min((t.seconds for t in verified), default=None)
    close = [t for t in verified if t.seconds <= best * RACE_WITHIN]
    if len(close) < 2:
        return None
    race = race_candidates(dict(request, candidates=[t.id for t in close], rounds=RACE_ROUNDS),
                           timeout * len(close))
    if race.remote_failed:
        _check_remote(remote, f"timing {len(close)} candidates for {request['signature']['op']} together")
    if race.failure:
        return race.failure
    for t in close:
        t.rounds = race.samples[t.id]
        t.seconds = statistics.median(t.rounds)
    return None


def _winner(tried: list[Tried]) -> str | None:
    """The fastest verified candidate, or the first in `SOURCE_PREFERENCE` of those its race
    cannot tell from it (None: none verified)."""
    verified = [t for t in tried if t.verified]
    if not verified:
        return None
    fastest = min(verified, key=lambda t: t.seconds)
    ties = [t for t in verified if t.rounds and fastest.rounds
            and PairedRatio.of_rounds(t.rounds, fastest.rounds).median_low <= 1.0]
    return min(ties or [fastest], key=lambda t: (SOURCE_PREFERENCE.index(t.id.split(":")[0]), t.seconds)).id


@quiet_tvm_logs()
def select_kernels(
    mod: tvm.IRModule,
    target: tvm.target.Target,
    *,
    external_dir: str | None = None,
    records: str | None = None,
    timeout: float = 120.0,
    min_repeat_ms: int = 20,
    remote: RemoteDevice | None = None,
    progress: Callable[[str], None] | None = None,
    generator: Generator | None = None,
    known: KernelSelection | None = None,
    deadline: float = float("inf"),
) -> KernelSelection:
    """Verify and time every candidate of every op signature in `mod` on `target` (on this
    machine, or on the `remote` device over TVM RPC), with a kernel `generator`'s candidates
    where one is given (kept in the records directory, which it needs); pick each op's winner
    (`_winner`). `progress` gets a line per candidate tried, per failed generator round and
    per race. Signatures go in order of work (multiply-adds times occurrences), most first;
    those `known` has a choice for keep it; none is started after `deadline`
    (`time.monotonic()`), so the selection returned may lack some of the model's signatures."""
    report = progress or (lambda line: None)
    if external_dir is not None:
        external_dir = os.path.abspath(external_dir)
    if generator is not None and records is None:
        raise GimletError("a kernel generator needs a records directory (its kernels are kept there)")
    if records is not None:
        records = RecordsDB(records, create=True).path  # the children read it
    generated_dir = os.path.join(records, GENERATED_DIR) if generator is not None else None
    target_json = json.loads(str(target))
    choices = {}
    # The most work first: under a deadline, the groups left are the ones that matter least.
    signatures = sorted(op_signatures(mod, target).items(), key=lambda item: -item[0].multiply_adds * item[1])
    for sig, count in signatures:
        if known is not None and sig.key in known.choices:
            choices[sig.key] = known.choices[sig.key]
            continue
        if time.monotonic() >= deadline:
            continue
        tried = []
        request = {"signature": sig.to_json(), "target": target_json, "external_dir": external_dir,
                   "generated_dir": generated_dir, "records": records, "min_repeat_ms": min_repeat_ms,
                   "remote": dataclasses.asdict(remote) if remote else None}
        rounds = []
        with Verifier() as verifier:
            # Generated code last: an untuned schedule is often far behind, and then timed once.
            for candidate in sorted(candidates(sig, target, external_dir), key=lambda c: c.source == "generated"):
                if candidate.unavailable is not None:
                    outcome = Outcome(False, f"unavailable: {candidate.unavailable}", verdict="unavailable")
                else:
                    fastest = min((t.seconds for t in tried if t.verified), default=None)
                    hopeless = HOPELESS * fastest if fastest and candidate.source == "generated" else None
                    outcome = _run(verifier, dict(request, candidate=candidate.id, hopeless_after=hopeless),
                                   timeout, remote)
                tried.append(Tried(candidate.id, candidate.provenance, outcome.verified, outcome.reason,
                                   outcome.seconds, candidate.digest, verdict=outcome.verdict))
                report(f"{sig.key}: {candidate.id} " + (f"{outcome.seconds * 1e3:.3f} ms" if outcome.verified
                                                         else f"no: {outcome.reason}"))
            if generator is not None and formats_for(sig, target):
                rounds = generate(sig, target, generator, generated_dir,
                                  lambda cid: _run(verifier, dict(request, candidate=cid), timeout, remote),
                                  tried, report)
        failure = _race_close(tried, request, timeout, remote)
        if failure is not None:
            warnings.warn(f"{sig.key}: the close candidates could not be timed together ({failure}); "
                          "their first timings decide")
        choices[sig.key] = OpChoice(sig, tried, _winner(tried), count, rounds)
        raced = [t for t in tried if t.rounds]
        if raced:
            report(f"{sig.key}: raced {len(raced)} in {RACE_ROUNDS} rounds: " + ", ".join(
                f"{t.id} {t.seconds * 1e3:.3f} ms" for t in raced) + f"; winner {choices[sig.key].winner}")
    measured = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return KernelSelection(target_key(target), choices, external_dir, measured,
                           remote.describe() if remote else "local", generated_dir)


def selected_sources(selection: KernelSelection) -> Iterable[str]:
    """The source of each op's winner."""
    return [c.winner.split(":")[0] for c in selection.choices.values() if c.winner]
