"""Verifying and timing one candidate, in a subprocess with a timeout.

The child builds the candidate alone (the op group, epilogue included, rewritten into it, then
the target's whole pipeline), runs it on random and edge-value inputs (epilogue addends too)
at the group's shapes and, for shape-generic candidates, at the edge-case shape (no
dimension a multiple of any tile), checks every output against the reference group (matmul
and epilogue in float64 numpy), and only then times the whole group on the device, caches
cold (`_time`). A compile error, a wrong result, a crash (signal), a hang (timeout) or a
device this machine lacks becomes the `reason` it is not verified.

    python -m gimlet_tvm.schedules.kernel_selection.verify < request.json
"""

from __future__ import annotations

import dataclasses
import json
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

RESULT_PREFIX = "GIMLET_RESULT "
# Timing rotates through operand copies of at least this many bytes in all (the 32 MiB L3 of
# the benchmark machine, three times over), at most MAX_COPIES, for MIN_RUNS runs or more.
COLD_BYTES = 96 << 20
MAX_COPIES = 64
MIN_RUNS = 5
# |ours - reference| must stay within this fraction of `OpSignature.error_scale` (float32 sums).
TOLERANCE = 1e-4


@dataclasses.dataclass
class Outcome:
    """What happened to one candidate: verified (then seconds is its time) or why not."""

    verified: bool
    reason: str = ""
    seconds: float | None = None
    checks: list[str] = dataclasses.field(default_factory=list)


def run_candidate(request: dict[str, Any], timeout: float) -> Outcome:
    """Verify and time the candidate `request` names, in a child process."""
    try:
        proc = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(request),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Outcome(False, f"timed out after {timeout:g} s (compile, run or check)")
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith(RESULT_PREFIX):
            return Outcome(**json.loads(line[len(RESULT_PREFIX):]))
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        return Outcome(False, f"crashed ({name}) while compiling, running or checking")
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
    return Outcome(False, f"child exited with code {proc.returncode}: {tail}")


def _build(mod, candidate, spec, target, tuned):
    """`mod` with its op group rewritten into `candidate`, built for `target`."""
    import tvm

    from ...compiler import relax_pipeline
    from .apply import rewrite_ops

    mod, _ = rewrite_ops(mod, lambda _: candidate, target.kind.name)
    with target, spec.codegen_hooks(target):
        return tvm.compile(mod, target, relax_pipeline=relax_pipeline(spec, target, tuned))


def _check(sig, candidate, spec, target, tuned) -> tuple[Any, str | None]:
    """Build `candidate` for `sig` and compare it with the reference; (executable, failure)."""
    import tvm
    from tvm import relax

    from ...errors import summary

    try:
        executable = _build(sig.module(), candidate, spec, target, tuned)
    except Exception as err:  # any error of the candidate's code or of TVM building it
        return None, f"compile failed at {sig.key}: {summary(err)}"
    cannot_run = spec.can_run()
    if cannot_run is not None:
        return executable, f"compiled; cannot run on this machine: {cannot_run}"
    dev = spec.device()
    vm = relax.VirtualMachine(executable, dev)
    for label, operands in sig.input_sets(np.random.default_rng(0)).items():
        args = [tvm.runtime.tensor(x.astype(sig.dtype), dev) for x in operands]
        got = vm["main"](*args).numpy().astype(np.float64)
        want = sig.reference(*[x.astype(sig.dtype) for x in operands])
        if got.shape != want.shape:
            return executable, f"wrong shape at {sig.key}: {got.shape}, expected {want.shape}"
        scale = sig.error_scale(operands)
        error = float(np.max(np.abs(got - want))) if got.size else 0.0
        if not np.isfinite(error) or error > TOLERANCE * scale:
            return executable, (f"wrong result at {sig.key} on {label} inputs: max abs error "
                                f"{error:.3g} > {TOLERANCE * scale:.3g}")
    return executable, None


def _time(executable, sig, spec, min_repeat_ms: int, build, hopeless_after: float | None) -> float:
    """Median seconds of one run of the op group, caches cold: the runs rotate through copies
    of its operands that together exceed `COLD_BYTES` (up to `MAX_COPIES`), as in a model
    whose other layers evict this group's weights. Where B is a weight, the copies of B are
    constants of one executable (`build(module)` builds it) whose run computes the group once
    with each, so a kernel that takes B in its own layout finds it converted at build time.
    With `hopeless_after` (given to generated code), a warm second run of `executable` slower
    than that many seconds is the answer: the candidate cannot win, and a default-scheduled
    GEMM would take minutes to time cold."""
    import tvm
    from tvm import relax

    dev = spec.device()
    operands = [x.astype(sig.dtype) for x in sig.input_sets(np.random.default_rng(1))["random"]]
    if hopeless_after is not None:
        warm = relax.VirtualMachine(executable, dev)
        args = [tvm.runtime.tensor(x, dev) for x in operands]
        warm["main"](*args)  # first touch of the tensors, thread pool
        begin = time.perf_counter()
        warm["main"](*args)
        dev.sync()
        if time.perf_counter() - begin > hopeless_after:
            return time.perf_counter() - begin
    count = min(MAX_COPIES, -(-COLD_BYTES // sum(x.nbytes for x in operands)))
    per_run = 1
    if sig.weight:
        weights = [operands[1] + np.float32(i) for i in range(count)]
        executable, operands, per_run = build(sig.module(weights)), [operands[0], *operands[2:]], count
        count = 1
    vm = relax.VirtualMachine(executable, dev)
    copies = [[tvm.runtime.tensor(x, dev) for x in operands] for _ in range(count)]
    vm["main"](*copies[0])  # warm-up: code, thread pool
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < MIN_RUNS or time.perf_counter() - start < min_repeat_ms * MIN_RUNS / 1e3:
        args = copies[len(times) % len(copies)]
        begin = time.perf_counter()
        vm["main"](*args)
        dev.sync()
        times.append((time.perf_counter() - begin) / per_run)
    return statistics.median(times)


def _child(request: dict[str, Any]) -> Outcome:
    import tvm

    from ...schedules.records import ApplyRecords, RecordsDB
    from ...targets import lookup
    from .candidates import OpSignature
    from .sources import find

    target = tvm.target.Target(request["target"])
    spec, _ = lookup(target.kind.name)
    sig = OpSignature.from_json(request["signature"])
    candidate = find(request["candidate"], sig, target, request.get("external_dir"))
    tuned = ApplyRecords(RecordsDB(request["records"]), target) if request.get("records") else None
    checks = [sig] + ([sig.edge_case()] if candidate.shape_generic else [])
    executable = None
    for checked in checks:
        built, failure = _check(checked, candidate, spec, target, tuned)
        if failure is not None:
            return Outcome(False, failure)
        executable = built if checked is sig else executable
    try:
        seconds = _time(executable, sig, spec, request["min_repeat_ms"],
                        lambda mod: _build(mod, candidate, spec, target, tuned), request.get("hopeless_after"))
    except Exception as err:  # pylint: disable=broad-except  # a run-time failure of the candidate
        return Outcome(False, f"verified but timing failed: {str(err).strip().splitlines()[-1][:200]}")
    return Outcome(True, "", seconds, [c.key for c in checks])


if __name__ == "__main__":
    outcome = _child(json.loads(sys.stdin.read()))
    print(RESULT_PREFIX + json.dumps(dataclasses.asdict(outcome)), flush=True)
