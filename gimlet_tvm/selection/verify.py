"""Verifying and timing one candidate, in a subprocess with a timeout.

The child builds the candidate alone (the op group, epilogue included, rewritten into it, then
the target's whole pipeline), runs it on random and edge-value inputs (epilogue addends too)
at the group's shapes (a rows-generic op's at two row counts: `OpSignature.variants`) and, for
shape-generic candidates, at the edge-case shape (no
dimension a multiple of any tile), checks every output against the reference group (the op
and its epilogue in float64 numpy), and only then times the whole group on the device, caches
cold (`_time`). The device is this machine's, or with a `remote` in the request the target's
device on a TVM RPC server (built here, uploaded, checked and timed there). A compile error, a
wrong result, a crash (signal), a hang (timeout) or a device this machine lacks becomes the
`reason` it is not verified, its kind the `verdict`; a failing remote step gives
`remote_failed` (the candidate may have crashed the server's session, or the device is gone:
the caller tells which).

Kernels from outside the compiler (external and generated: `Candidate.kernel`) are checked
harder: their object may call libc's memory functions and libm only (`external.ALLOWED_CALLS`:
no processes, files or network: "unsafe"); on inputs with a NaN and an Inf their output must
have NaN and Inf exactly where the float64 reference has them; and run on their own into an
output buffer filled first with one poison, then another, they must give the same result
("uninitialised output" otherwise). Each also runs on operands that each end where an
inaccessible page begins, then that each begin right after one, its inputs read-only: a fault
there (and not on ordinary arrays) is an "out-of-bounds access". A C kernel is called directly
for this, first (`out_of_bounds`: `guard_pages` in a process of its own, exact placement, the
operand named); a TVMScript kernel here, after one run on ordinary arrays and before its
poisoned runs, whose results a read past an operand's end could change (`_guard_pages`: DLPack
wants 64-byte aligned data, so an array may end up to 60 bytes short of its page), the fault ending
this child, which `Verifier` reads by the stage the child announced (the guard pages are this
machine's host memory: for a remote device or a GPU they are skipped, the rest runs there). A
C kernel split into tasks (`CSource`) also runs its tasks concurrently, in order and in
reverse order (`task_orders`): an output that differs between those is a "race" (tasks
writing one element, or reading what another writes). The child runs in a
session of its own under resource limits (`_limit_cpu`, `_limit_memory`: CPU time, address space), and its whole
process group is killed when it runs past its time ("timeout").

A request naming several `candidates` (verified before) is a race instead: one child builds
each for timing, then times them in turn, round after round (`race_candidates`), so near
equals are compared under the same load and not by one timing each, minutes apart.

A child serves request after request (`Verifier`: one per op group in `select_kernels`), as
importing TVM costs seconds per process and a conv group has a dozen candidates. Each request
is one line on the child's stdin, answered by its stage markers and one result line; its time
runs from when it is sent (the parent kills the child's process group at `timeout`) and the
child sets its CPU limit afresh for it (`_limit_cpu`). A child that dies (signal, CPU limit,
exit) or is killed gives the request it was on the verdict a child of its own would have
had; the next request starts a fresh one. A forkserver with TVM preloaded would save the
import too, but forking a process whose TVM thread pool and log-filter threads already run
is not safe; a reused child keeps the simple spawn. The price: candidates of one group share
a process, so one that corrupts memory without faulting could in principle upset a later
one's checks (it could as well pass its own: what the checks guard is the model, not the
selection).

    python -m gimlet_tvm.selection.verify < requests.jsonl   (one request a line)
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import queue
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import tvm
from tvm import relax

from ..compiler import relax_pipeline
from ..errors import RemoteDeviceError, summary
from ..logs import quiet_tvm_logs
from ..peers import interleaved
from ..runtime.remote import RemoteDevice
from ..errors import UnsafeKernelError
from ..schedules.kernel_selection.apply import rewrite_ops
from ..schedules.kernel_selection.candidates import CSource, OpSignature
from ..schedules.kernel_selection.external import shared_library
from ..schedules.kernel_selection.sources import find
from ..schedules.tuning.records import ApplyRecords, RecordsDB
from ..targets import spec_for
from . import guard_pages

RESULT_PREFIX = "GIMLET_RESULT "
STAGE_PREFIX = "GIMLET_STAGE "  # the child announces a stage whose crash means something of its own
GUARD_STAGE = "guard pages"
FAULTS = {-signal.SIGSEGV: "SIGSEGV", -signal.SIGBUS: "SIGBUS"}
# Timing rotates through operand copies of at least this many bytes in all (three times a
# large server L3; where the L3 is larger, "cold" is at best cooler), at most MAX_COPIES, for
# MIN_RUNS runs or more.
COLD_BYTES = 96 << 20
MAX_COPIES = 64
MIN_RUNS = 5
# |ours - reference| must stay within this fraction of `OpSignature.error_scale` (float32 sums).
TOLERANCE = 1e-4
VERDICTS = ("ok", "unavailable", "compile error", "unsafe", "cannot run", "out-of-bounds access", "race",
            "wrong result", "uninitialised output", "crash", "timeout", "timing failed", "remote failure")
"""What became of a candidate: `Outcome.verdict` (a kernel generator is told it)."""
POISONS = (np.nan, -3.0e38)
"""What an outside kernel's output buffer holds before each of its two poisoned runs."""
KERNEL_CHECKS = ("calls: libc memory functions and libm only",
                 "outputs against the float64 reference: random, integer, large, zero inputs",
                 "NaN/Inf propagation", "uninitialised output: two poisons",
                 "guard pages: C exact, TVMScript 64-byte aligned",
                 "C tasks: concurrent, in order and reversed give one output")
"""The checks an outside kernel passes to be verified (the accepted-kernel cache keys on them)."""


@dataclasses.dataclass
class Outcome:
    """What happened to one candidate: verified (then seconds is its time) or why not."""

    verified: bool
    reason: str = ""
    seconds: float | None = None
    checks: list[str] = dataclasses.field(default_factory=list)
    remote_failed: bool = False  # a step on the remote device failed (the candidate, or the device?)
    verdict: str = "ok"  # one of VERDICTS


@dataclasses.dataclass
class Race:
    """Verified candidates timed against each other: id -> seconds per round, or why not."""

    samples: dict[str, list[float]]
    failure: str = ""
    remote_failed: bool = False


def run_candidate(request: dict[str, Any], timeout: float) -> Outcome:
    """Verify and time the candidate `request` names, in a child process of its own."""
    with Verifier() as verifier:
        return verifier.run(request, timeout)


def race_candidates(request: dict[str, Any], timeout: float) -> Race:
    """Time the verified candidates `request["candidates"]` of one op group against each other
    in one child process: `request["rounds"]` rounds, each timing every candidate once (caches
    cold, as `_time`), in balanced orders (`peers.interleaved`)."""
    with Verifier() as verifier:
        result = verifier.result(request, timeout)
    return Race({}, result[1]) if isinstance(result, tuple) else Race(**result)


def _limit_memory() -> None:
    """In the child before it starts: no more address space than this machine has memory."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))


def _limit_cpu(timeout: float) -> None:
    """In the child before each request: at most `timeout` seconds of CPU time per core (its
    threads together) from now on. The hard limit stays as it is (unlimited, as a rule) so that
    the next request can raise the soft one again; going past the soft one sends SIGXCPU,
    which kills."""
    cpu = math.ceil(sum(os.times()[:2]) + timeout * (os.cpu_count() or 1))
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu if hard == resource.RLIM_INFINITY else min(cpu, hard), hard))


class Verifier:
    """A child process that verifies (or races) one request after another, started when the
    first comes and again after one that ended it; `close` (or leaving the `with`) ends it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lines: queue.Queue = queue.Queue()
        self._stderr = None

    def __enter__(self) -> "Verifier":
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def run(self, request: dict[str, Any], timeout: float) -> Outcome:
        """Verify and time the candidate `request` names (at most `timeout` seconds)."""
        result = self.result(request, timeout)
        return Outcome(False, result[1], verdict=result[0]) if isinstance(result, tuple) else Outcome(**result)

    def result(self, request: dict[str, Any], timeout: float) -> dict[str, Any] | tuple[str, str]:
        """The child's result for `request`, or (verdict, why there is none). The child leads a
        process group of its own, killed whole when it runs past `timeout`."""
        if self._proc is not None and self._proc.poll() is not None:  # it died since the last request
            self.close()
        if self._proc is None:
            self._start()
        err_start = os.fstat(self._stderr.fileno()).st_size
        try:
            self._proc.stdin.write(json.dumps(dict(request, timeout=timeout)) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:  # it died just now; its stdout ends, below
            pass
        deadline, stages = time.monotonic() + timeout, []
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                return "timeout", f"timed out after {timeout:g} s (compile, run or check)"
            if line is None:  # stdout closed: the child is gone
                returncode = self._proc.wait()
                self._stderr.seek(err_start)
                err = self._stderr.read().decode(errors="replace")
                self.close()
                return _death(request, returncode, stages, err)
            if line.startswith(RESULT_PREFIX):
                return json.loads(line[len(RESULT_PREFIX):])
            if line.startswith(STAGE_PREFIX):
                stages.append(line[len(STAGE_PREFIX):].rstrip("\n"))

    def close(self) -> None:
        """End the child and whatever it started."""
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait()
        self._proc.stdin.close()
        self._stderr.close()
        self._proc = self._stderr = None

    def _start(self) -> None:
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, text=True, start_new_session=True,
                                      preexec_fn=_limit_memory)
        self._lines = queue.Queue()  # a line of stdout at a time, then None
        threading.Thread(target=_pump, args=(self._proc.stdout, self._lines), daemon=True).start()


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    stream.close()
    lines.put(None)


def _death(request: dict[str, Any], returncode: int, stages: list[str], err: str) -> tuple[str, str]:
    """(verdict, reason) for the request a child was on when it ended with `returncode`,
    having announced `stages` and written `err` to stderr since the request began."""
    if returncode in FAULTS and stages[-1:] == [GUARD_STAGE]:
        key = OpSignature.from_json(request["signature"]).key
        return "out-of-bounds access", (f"out-of-bounds access at {key}: {FAULTS[returncode]} with each operand "
                                        "against a guard page (after its end, within 60 bytes, or before its start)")
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout", f"ran past its CPU time limit ({signal.Signals(-returncode).name})"
    if returncode < 0:
        return "crash", f"crashed ({signal.Signals(-returncode).name}) while compiling, running or checking"
    tail = (err.strip().splitlines() or ["no output"])[-1][:200]
    return "crash", f"child exited with code {returncode}: {tail}"


def _build(mod, candidate, spec, target, tuned):
    """`mod` with its op group rewritten into `candidate`, built for `target`."""

    mod, _ = rewrite_ops(mod, lambda _: candidate, target)
    with target, spec.codegen_hooks(target):
        return tvm.compile(mod, target, relax_pipeline=relax_pipeline(spec, target, tuned))


class _Machine:
    """Where the candidate runs: this machine's device for the target, or (`remote`) that
    device on a TVM RPC server, each remote step under the device's deadline."""

    def __init__(self, spec, remote=None) -> None:
        self.spec, self.remote = spec, remote
        self.loaded = 0
        if remote is None:
            self.device = spec.device()
        else:
            self.session = remote.connect()
            self.device = self.session.device(spec.device().dlpack_device_type(), 0)

    def cannot_run(self) -> str | None:
        """Why this machine cannot run the target's code (a remote device is asked by running)."""
        return self.spec.can_run() if self.remote is None else None

    def load(self, executable):
        """A VM of `executable` on the device (uploaded first when it is remote)."""
        if self.remote is None:
            return relax.VirtualMachine(executable, self.device)
        self.loaded += 1
        name = f"candidate{self.loaded}.so"
        with tempfile.TemporaryDirectory(prefix="gimlet-select-") as folder:
            path = os.path.join(folder, name)
            executable.export_library(path)
            self.remote.call("upload", lambda: self.session.upload(path))
        module = self.remote.call("load", lambda: self.session.load_module(name))
        return self.remote.call("load", lambda: relax.VirtualMachine(module, self.device))

    def step(self, what: str, func):
        return func() if self.remote is None else self.remote.call(what, func)

    def tensors(self, arrays: list[np.ndarray]) -> list:
        return self.step("copy inputs", lambda: [tvm.runtime.tensor(x, self.device) for x in arrays])

    def run(self, vm, args: list) -> np.ndarray:
        return self.step("run", lambda: vm["main"](*args).numpy())

    def run_in_place(self, vm, args: list) -> np.ndarray:
        """Run `main`, which writes its last argument, and read that back. (TVM RPC cannot
        return a function's own argument: `main` returns it in a tuple, left on the device.)"""
        self.step("run", lambda: vm["main"](*args))
        return self.step("run", lambda: args[-1].numpy())

    def seconds(self, vm, copies: list[list], runs: int, min_repeat_ms: int) -> list[float]:
        """Times of runs of `main`: here at least `runs`, and `runs` x `min_repeat_ms` ms in all,
        each run taking the next set of `copies`; remotely `runs` times measured by the device
        itself (TVM's time evaluator: no network in them; each one the mean over at least
        `min_repeat_ms` ms of runs) on the first set."""
        times: list[float] = []
        if self.remote is not None:
            evaluator = vm.time_evaluator("main", self.device, number=1, repeat=runs,
                                          min_repeat_ms=min_repeat_ms)
            return list(self.step("time", lambda: evaluator(*copies[0])).results)
        start = time.perf_counter()
        while len(times) < runs or time.perf_counter() - start < min_repeat_ms * runs / 1e3:
            args = copies[len(times) % len(copies)]
            begin = time.perf_counter()
            vm["main"](*args)
            self.device.sync()
            times.append(time.perf_counter() - begin)
        return times


def _check(sig, candidate, machine: _Machine, target, tuned) -> tuple[Any, Outcome | None]:
    """Build `candidate` for `sig` and compare it with the reference; (executable, failure)."""

    try:
        if candidate.kernel is not None:  # its own checks first, outside the passes that would wrap their errors
            candidate.kernel(sig)
        executable = _build(sig.module(), candidate, machine.spec, target, tuned)
    except UnsafeKernelError as err:
        return None, Outcome(False, f"unsafe: {err}", verdict="unsafe")
    except Exception as err:  # any error of the candidate's code or of TVM building it
        return None, Outcome(False, f"compile failed at {sig.key}: {summary(err)}", verdict="compile error")
    cannot_run = machine.cannot_run()
    if cannot_run is not None:
        return executable, Outcome(False, f"compiled; cannot run on this machine: {cannot_run}",
                                   verdict="cannot run")
    if candidate.kernel is not None:
        # Operands against guard pages are this machine's host memory: a remote device or a GPU
        # skips them.
        alone = _alone(sig, candidate, machine, target, tuned)
        local = machine.remote is None and machine.spec.is_cpu
        if candidate.c_source is not None and local:  # called on its own in a process of its own
            failure = (out_of_bounds(sig, candidate.c_source, target) or task_orders(sig, candidate.c_source, target)
                       or _poisoned(sig, machine, alone))
        else:  # here; against guard pages before the poisons, which out-of-bounds reads could see
            if local:
                _guard_pages(sig, machine, alone)  # a fault ends this child
            failure = _poisoned(sig, machine, alone)
        if failure is not None:
            return executable, failure
    vm = machine.load(executable)
    for label, operands in sig.input_sets(np.random.default_rng(0)).items():
        got = machine.run(vm, machine.tensors(sig.cast(operands))).astype(np.float64)
        want = sig.reference(*sig.cast(operands))
        if got.shape != want.shape:
            return executable, Outcome(False, f"wrong shape at {sig.key}: {got.shape}, expected {want.shape}",
                                       verdict="wrong result")
        scale = sig.error_scale(operands)
        error = float(np.max(np.abs(got - want))) if got.size else 0.0
        if not np.isfinite(error) or error > TOLERANCE * scale:
            return executable, Outcome(False, f"wrong result at {sig.key} on {label} inputs: max abs error "
                                       f"{error:.3g} > {TOLERANCE * scale:.3g}", verdict="wrong result")
    return executable, _propagates(sig, machine, vm) if candidate.kernel is not None else None


def _special_operands(sig) -> list[np.ndarray]:
    """Random operands with a NaN as the first operand's first element and an Inf as its last."""
    operands = sig.cast(sig.input_sets(np.random.default_rng(2))["random"])
    operands[0].flat[0], operands[0].flat[-1] = np.nan, np.inf
    return operands


def _propagates(sig, machine: _Machine, vm) -> Outcome | None:
    """None when the output has NaN and each infinity exactly where the reference does (after
    a ReLU a NaN may also be 0: LLVM's max, as the compiler's own ReLU, returns the number; where
    the op says so, an infinity may also be NaN: `OpKind.inf_may_be_nan`)."""
    operands = _special_operands(sig)
    got = machine.run(vm, machine.tensors(operands)).astype(np.float64)
    want = sig.reference(*operands)
    nan_may_vanish = any(kind == "relu" for kind, _ in sig.epilogue)
    lost_nan = np.isnan(want) & ~np.isnan(got) & ~(nan_may_vanish & (got == 0))
    infinite = np.isinf(want) & (got != want) & ~(sig.kind.inf_may_be_nan & np.isnan(got))
    wrong = (np.isnan(got) & ~np.isnan(want)) | lost_nan | infinite
    if wrong.any():
        where = tuple(int(i) for i in np.argwhere(wrong)[0])
        return Outcome(False, f"wrong result at {sig.key} on NaN/Inf inputs: {got[where]} at {where}, "
                       f"expected {want[where]} (NaN and Inf must propagate)", verdict="wrong result")
    return None


def _guard_pages_run(job: dict[str, Any]) -> subprocess.CompletedProcess:
    """`guard_pages` run on `job`, in a process of its own."""
    return subprocess.run([sys.executable, "-I", guard_pages.__file__], input=json.dumps(job), text=True,
                          capture_output=True, check=False)


def _guard_pages_job(sig, c_source: CSource, target) -> dict[str, Any]:
    """What `guard_pages` needs to call the C kernel: its library and function, the shapes and
    dtypes of `OpSignature.kernel_operands`, its scalars (a rows-generic op's row count) and
    tasks."""
    return {"library": str(shared_library(c_source.path, target)), "function": c_source.function,
            "shapes": [list(shape) for _, shape in sig.kernel_operands()], "dtypes": sig.kernel_dtypes(),
            "scalars": [sig.shapes[0][0]] if sig.kind.rows_generic else [], "tasks": c_source.tasks}


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[-1][:200]


def out_of_bounds(sig, c_source: CSource, target) -> Outcome | None:
    """None when the C kernel `c_source` runs without a fault on operands placed against
    guard pages, after their ends and then before their starts, its inputs read-only;
    otherwise an "out-of-bounds access", naming the operand found by protecting each alone, or
    a "crash" where it also fails on ordinary arrays (a stray access far from every operand)
    or fails otherwise."""
    operands = sig.kernel_operands()
    every = list(range(len(operands)))

    def run(placement: str, protect: list[int]) -> tuple[int, str]:
        done = _guard_pages_run({**_guard_pages_job(sig, c_source, target), "placement": placement,
                                 "protect": protect})
        return done.returncode, _last_line(done.stderr)

    for placement, where in (("end", "past the end of"), ("start", "before the start of")):
        status, error = run(placement, every)
        if status == 0:
            continue
        if status in FAULTS:
            status, error = run(placement, [])
        if status != 0:
            how = FAULTS.get(status, f"exit status {status}")
            return Outcome(False, f"crashed ({how}) at {sig.key} when called on its own: {error or 'no error output'}",
                           verdict="crash")
        culprit = next((i for i in every if run(placement, [i])[0] in FAULTS), None)
        what = "its operands together" if culprit is None else operands[culprit][0]
        written = " (or writes this input)" if culprit is not None and culprit < len(operands) - 1 else ""
        return Outcome(False, f"out-of-bounds access at {sig.key}: faults with each operand against a guard page, "
                       f"{where} {what}{written}", verdict="out-of-bounds access")
    return None


def task_orders(sig, c_source: CSource, target) -> Outcome | None:
    """None when the C kernel `c_source` has one task, or gives one output with its tasks run
    concurrently, in order and in reverse order (`guard_pages`); otherwise a "race"."""
    if c_source.tasks == 1:
        return None
    done = _guard_pages_run({**_guard_pages_job(sig, c_source, target), "orders": True})
    if done.returncode != 0:
        how = FAULTS.get(done.returncode, f"exit status {done.returncode}")
        return Outcome(False, f"crashed ({how}) at {sig.key} running its {c_source.tasks} tasks: "
                       f"{_last_line(done.stderr) or 'no error output'}", verdict="crash")
    found = json.loads(done.stdout)
    if found["differ"]:
        return Outcome(False, f"race at {sig.key}: {found['differ']} of {found['size']} output elements differ between "
                       f"its {c_source.tasks} tasks run concurrently, in order and in reverse order (first at "
                       f"{tuple(found['first'])}): each output element must be written by one task alone",
                       verdict="race")
    return None


def _alone(sig, candidate, machine: _Machine, target, tuned):
    """A VM whose `main` runs the outside kernel on its own, in place: on the arrays of
    `OpSignature.kernel_operands` as given (the output last; read it with
    `_Machine.run_in_place`)."""
    shapes = [shape for _, shape in sig.kernel_operands()]
    params = [relax.Var(f"arg{i}", relax.TensorType(shape, dtype))
              for i, (shape, dtype) in enumerate(zip(shapes, sig.kernel_dtypes()))]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        func = candidate.kernel(sig).with_attr("op_pattern", 8).without_attr("global_symbol")
        out = bb.emit(relax.call_tir_inplace(bb.add_func(func, "kernel"), params, [len(params) - 1],
                                             relax.TensorType(shapes[-1], sig.dtype)))
        bb.emit_func_output(relax.Tuple([out]))
    return machine.load(_build(bb.finalize(), candidate, machine.spec, target, tuned))


def _guard_pages(sig, machine: _Machine, alone) -> None:
    """Run the kernel on its own (`alone`) on operands against guard pages, inputs read-only:
    each ending where a PROT_NONE page begins, then each beginning right after one. TVM takes
    DLPack data 64-byte aligned only, so an array whose size is no multiple of 64 bytes ends
    up to 60 bytes before its page (exact for C kernels: `out_of_bounds`). A fault kills this
    child: `Verifier` reads it as an out-of-bounds access by the stage announced here, after one
    run on ordinary arrays (a crash there is a crash, not an out-of-bounds access)."""
    rng = np.random.default_rng(4)
    shapes, dtypes = [shape for _, shape in sig.kernel_operands()], sig.kernel_dtypes()
    inputs = [rng.standard_normal(s).astype(d) for s, d in zip(shapes[:-1], dtypes)]
    machine.run_in_place(alone, machine.tensors([*inputs, np.zeros(shapes[-1], sig.dtype)]))
    print(STAGE_PREFIX + GUARD_STAGE, flush=True)
    for at_end in (True, False):
        operands = [guard_pages.Guarded(shape, at_end, align=64, dtype=dtype) for shape, dtype in zip(shapes, dtypes)]
        tensors = []
        for index, operand in enumerate(operands):
            operand.array[...] = rng.standard_normal(operand.array.shape).astype(operand.array.dtype) if index < len(
                operands) - 1 else 0
            tensors.append(tvm.runtime.from_dlpack(operand.array))
            if index < len(operands) - 1:
                operand.read_only()
        machine.run_in_place(alone, tensors)
    print(STAGE_PREFIX + "checks", flush=True)


def _poisoned(sig, machine: _Machine, alone) -> Outcome | None:
    """None when the kernel, run on its own (`alone`) into an output buffer holding each of
    `POISONS`, gives the same output: every element written, none read before."""
    shapes = [shape for _, shape in sig.kernel_operands()]
    inputs = [x.reshape(shape) for x, shape in zip(sig.input_sets(np.random.default_rng(3))["random"], shapes)]
    outputs = [machine.run_in_place(alone, machine.tensors([*sig.cast(inputs),
                                                   np.full(shapes[-1], poison, sig.dtype)]))
               for poison in POISONS]
    differ = ~((outputs[0] == outputs[1]) | (np.isnan(outputs[0]) & np.isnan(outputs[1])))
    if differ.any():
        return Outcome(False, f"uninitialised output at {sig.key}: {int(differ.sum())} of {differ.size} elements "
                       f"keep what the output buffer held (first at {tuple(int(i) for i in np.argwhere(differ)[0])})",
                       verdict="uninitialised output")
    return None


class _ColdTiming:
    """One candidate of an op group, ready to be timed caches cold: its runs rotate through
    copies of the group's operands that together exceed `COLD_BYTES` (up to `MAX_COPIES`), as
    in a model whose other layers evict this group's weights. Where B is a weight, the copies
    of B are constants of one executable (`build(module)` builds it) whose run computes the
    group once with each, so a kernel that takes B in its own layout finds it converted at
    build time (on a remote device only these rotate: the other operands are timed warm).
    Otherwise `executable` (built by `build` when not given) is timed."""

    def __init__(self, sig, machine: _Machine, build, executable=None) -> None:
        operands = sig.cast(sig.input_sets(np.random.default_rng(1))["random"])
        count = min(MAX_COPIES, -(-COLD_BYTES // sum(x.nbytes for x in operands)))
        self.machine, self.per_run = machine, 1
        if sig.weight:
            weights = [operands[1] + np.float32(i) for i in range(count)]
            executable, operands, self.per_run = build(sig.module(weights)), [operands[0], *operands[2:]], count
            count = 1
        elif executable is None:
            executable = build(sig.module())
        self.vm = machine.load(executable)
        self.copies = [machine.tensors(operands) for _ in range(count if machine.remote is None else 1)]
        machine.step("run", lambda: self.vm["main"](*self.copies[0]))  # warm-up: code, thread pool

    def seconds(self, min_repeat_ms: int) -> float:
        """Median seconds of one run of the group."""
        times = self.machine.seconds(self.vm, self.copies, MIN_RUNS, min_repeat_ms)
        return statistics.median(times) / self.per_run


def _time(executable, sig, machine: _Machine, min_repeat_ms: int, build, hopeless_after: float | None) -> float:
    """Median seconds of one run of the op group, caches cold (`_ColdTiming`).
    With `hopeless_after` (given to generated code), a warm second run of `executable` slower
    than that many seconds is the answer: the candidate cannot win, and a default-scheduled
    GEMM would take minutes to time cold."""
    if hopeless_after is not None:
        operands = sig.cast(sig.input_sets(np.random.default_rng(1))["random"])
        warm, args = machine.load(executable), machine.tensors(operands)
        machine.run(warm, args)  # first touch of the tensors, thread pool
        (seconds,) = machine.seconds(warm, [args], 1, 0)
        if seconds > hopeless_after:
            return seconds
    return _ColdTiming(sig, machine, build, executable).seconds(min_repeat_ms)


def _setup(request: dict[str, Any]):
    """The request's target, its spec, the op signature, the tuning records and the machine."""

    target = tvm.target.Target(request["target"])
    spec = spec_for(target)
    sig = OpSignature.from_json(request["signature"])
    tuned = ApplyRecords(RecordsDB(request["records"]), target) if request.get("records") else None
    remote = RemoteDevice(**request["remote"]) if request.get("remote") else None
    return target, spec, sig, tuned, lambda: _Machine(spec, remote)


def _child(request: dict[str, Any]) -> Outcome:

    target, spec, sig, tuned, machine = _setup(request)
    candidate = find(request["candidate"], sig, target, request.get("external_dir"), request.get("generated_dir"))
    checks = [sig, *sig.variants()] + ([sig.edge_case()] if candidate.shape_generic else [])
    try:
        machine = machine()
        executable = None
        for checked in checks:
            built, failure = _check(checked, candidate, machine, target, tuned)
            if failure is not None:
                return failure
            executable = built if checked is sig else executable
        try:
            seconds = _time(executable, sig, machine, request["min_repeat_ms"],
                            lambda mod: _build(mod, candidate, spec, target, tuned), request.get("hopeless_after"))
        except RemoteDeviceError:
            raise
        except Exception as err:  # pylint: disable=broad-except  # a run-time failure of the candidate
            return Outcome(False, f"verified but timing failed: {str(err).strip().splitlines()[-1][:200]}",
                           verdict="timing failed")
    except RemoteDeviceError as err:
        return Outcome(False, str(err), remote_failed=True, verdict="remote failure")
    return Outcome(True, "", seconds, [c.key for c in checks])


def _race_child(request: dict[str, Any]) -> Race:

    target, spec, sig, tuned, machine = _setup(request)
    ids = request["candidates"]
    try:
        machine = machine()
        timings = {}
        for cid in ids:
            candidate = find(cid, sig, target, request.get("external_dir"), request.get("generated_dir"))
            timings[cid] = _ColdTiming(sig, machine, lambda mod, c=candidate: _build(mod, c, spec, target, tuned))
        samples: dict[str, list[float]] = {cid: [] for cid in ids}
        for cid in interleaved(ids, request["rounds"]):
            samples[cid].append(timings[cid].seconds(request["min_repeat_ms"]))
    except RemoteDeviceError as err:
        return Race({}, str(err), remote_failed=True)
    except Exception as err:  # pylint: disable=broad-except  # a candidate's build or run
        return Race({}, f"timing together failed: {summary(err)}")
    return Race(samples)


def _serve() -> None:
    """The child: a request a line on stdin, each answered by a result line on stdout."""
    with quiet_tvm_logs():  # a failure's reason is our stderr's last line: keep TVM's off it
        for line in sys.stdin:
            job = json.loads(line)
            _limit_cpu(job["timeout"])
            result = _race_child(job) if "candidates" in job else _child(job)
            print(RESULT_PREFIX + json.dumps(dataclasses.asdict(result)), flush=True)
            gc.collect()  # the request's TVM objects (they form cycles)


if __name__ == "__main__":
    _serve()
