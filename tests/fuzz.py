"""Fuzzing: broken models, artifacts, tuning records and inputs through `build`, `load`, `run` and
the CLI. Every case must end in a typed error (a `GimletError`) or a correct result: never a
crash, a hang, another exception, a wrong result or a half-written file.

    python -m tests.fuzz --minutes 60 [--seed S] [--corpus DIR] [--all]

Seed models are in `tests/fuzz_seeds.py`, the mutators in `tests/fuzz_mutators.py`. Cases run
in a worker process (one at a time, each in a fresh folder), so a crash (the worker
dies) or a hang (no answer within `--timeout` seconds) is caught and the worker replaced. A
round runs every mutator of every stage once, on the seed models in turn (`tests/fuzz_seeds`);
`--minutes` runs rounds until the time is up. Each finding's input is saved in the corpus
(`tests/fuzz_corpus/`: the input, gzipped, named by its content hash, and `HASH.case.json` saying the
stage, the seed, the mutator and what went wrong), which `tests/test_fuzz.py` replays.

Stages and their input:
- `build`: a mutated ONNX model (bytes) to `gimlet_tvm.build`; a model that builds is run on
  random inputs and compared with onnxruntime (where onnxruntime accepts the model).
- `compile`: the same through `gimlet-tvm compile` then `gimlet-tvm run` (in-process `main`):
  exit 0 or 2, and no file but the ones asked for.
- `load`: a mutated artifact (the seed's, exported) to `gimlet_tvm.load` and `gimlet-tvm run`;
  one that loads must compute the seed's outputs.
- `run`: a mutated `.npz` of inputs to the seed's artifact, through `CompiledModel.run` and
  `gimlet-tvm run --inputs`; `call`: Python objects (JSON) to `CompiledModel(*args)`.
- `records`: a mutated tuning-records directory (as JSON {file: text}) to `gimlet-tvm records
  validate|list|stats|best` and to `build(..., records=)`.

Mutated artifacts keep a library whose checksum matches only by accident: an artifact is a
shared library, and one altered on purpose with its checksum recomputed runs what it holds,
which no loader can make safe.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gzip
import hashlib
import io
import json
import math
import multiprocessing
import os
import re
import resource
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
from onnx import helper

import tvm
from tvm.s_tir import meta_schedule as ms

import gimlet_tvm
from gimlet_tvm.cli import main as cli_main
from gimlet_tvm.errors import GimletError
from gimlet_tvm.peers import onnxruntime_session
from gimlet_tvm.runtime.tensors import random_inputs
from gimlet_tvm.schedules.tuning.records import RecordsDB, record_json
from gimlet_tvm.tuning import extract_tasks

from .fuzz_mutators import MUTATORS, arrays_of, npz_of
from .fuzz_seeds import RECORDS_SEED, SEEDS

CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
TIMEOUT = 120.0
"""Seconds a case may take before it counts as a hang (a seed model builds in about one)."""
MEMORY_LIMIT = 8 << 30
"""Address space of the worker: a model that asks for a huge allocation fails instead of
taking the machine down."""
MAX_RUN_ELEMENTS = 1 << 22
"""A model built from mutated shapes is run only when its inputs are at most this many elements."""
TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}
EXTENSIONS = {"build": ".onnx", "compile": ".onnx", "load": ".so", "run": ".npz", "call": ".json",
              "records": ".json"}
KNOWN = {
    ("run", "nan_inf", "softmax"): "Relu(NaN) is 0 here (TVM's max(x, 0)), NaN in onnxruntime: "
    "the Softmax after it then gives finite values where onnxruntime gives NaN",
    ("run", "nan_inf", "conv"): "Relu(NaN) is 0 here, NaN in onnxruntime: after Conv over NaN and "
    "inf inputs, some outputs differ (0 against inf)",
}
"""(stage, mutator, seed) cases whose findings are known and wait for a fix, with what goes
wrong: left out of rounds unless `--all` asks for them."""


# ---- cases and their outcomes ---------------------------------------------------------------

@dataclasses.dataclass
class Case:
    """One input for one stage; `seed` names the seed model it was made from."""

    stage: str
    seed: str
    mutator: str
    payload: bytes

    def digest(self) -> str:
        return hashlib.sha256(self.stage.encode() + b"\0" + self.payload).hexdigest()[:20]


@dataclasses.dataclass
class Outcome:
    """`status`: "ok" (a correct result, or one no reference could check), "typed" (a
    GimletError), or a finding: "crash", "hang", "untyped", "wrong", "leftover", "cli"."""

    status: str
    detail: str = ""

    @property
    def finding(self) -> bool:
        return self.status not in ("ok", "typed")

    def signature(self, case: "Case") -> str:
        """What makes two findings the same: stage, mutator, status and the message without its
        numbers, paths and quoted names (the corpus keeps one input of each)."""
        message = re.sub(r"\d+|'[^']*'|/\S*", "", self.detail)
        return f"{case.stage}/{case.mutator}/{self.status}/{message[:80]}"


class Finding(Exception):
    """Raised inside the worker when a case fails a check."""

    def __init__(self, status: str, detail: str):
        super().__init__(detail)
        self.status = status


# ---- the worker: runs cases ------------------------------------------------------------------

class Checker:
    """Runs cases of every stage against seed material in `workdir` (made by `prepare`)."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self._models: dict[str, Any] = {}

    def prepare(self) -> dict[str, str]:
        """Export each seed's artifact, write the seed records: paths, by name."""
        paths = {}
        os.makedirs(os.path.join(self.workdir, "seeds"), exist_ok=True)
        for name, make in SEEDS.items():
            paths[name] = os.path.join(self.workdir, "seeds", f"{name}.so")
            gimlet_tvm.build(make(), "llvm").export(paths[name])
        paths["records"] = os.path.join(self.workdir, "seeds", "records")
        _seed_records(paths["records"])
        return paths

    def run(self, case: Case) -> Outcome:
        folder = tempfile.mkdtemp(prefix=f"{case.stage}-", dir=self.workdir)
        try:
            getattr(self, f"_{case.stage}")(case, folder)
            return Outcome("ok")
        except Finding as err:
            return Outcome(err.status, str(err))
        except GimletError as err:
            return Outcome("typed", f"{type(err).__name__}: {err}")
        except Exception as err:
            frames = traceback.extract_tb(err.__traceback__)
            where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
            return Outcome("untyped", f"{type(err).__name__}: {str(err)[:500]}{where}")
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    # stages
    def _build(self, case: Case, folder: str) -> None:
        model = gimlet_tvm.build(case.payload, "llvm")
        _check_against_reference(model, case.payload, None)

    def _compile(self, case: Case, folder: str) -> None:
        _write(folder, "model.onnx", case.payload)
        expected = {"model.onnx"}
        if _cli(folder, "compile", "model.onnx", "-o", "out.so") == 0:
            expected.add("out.so")
            if _cli(folder, "run", "out.so", "--outputs", "out.npz") == 0:
                expected.add("out.npz")
        _check_files(folder, expected)

    def _load(self, case: Case, folder: str) -> None:
        _write(folder, "model.so", case.payload)
        expected = {"model.so"}
        if _cli(folder, "run", "model.so", "--outputs", "out.npz") == 0:
            expected.add("out.npz")
        _check_files(folder, expected)
        model = gimlet_tvm.load(os.path.join(folder, "model.so"))
        _check_against_reference(model, SEEDS[case.seed]().SerializeToString(), _seed_inputs(case.seed))

    def _run(self, case: Case, folder: str) -> None:
        _write(folder, "in.npz", case.payload)
        expected = {"in.npz"}
        if _cli(folder, "run", self._artifact(case.seed), "--inputs", "in.npz", "--outputs", "out.npz") == 0:
            expected.add("out.npz")
        _check_files(folder, expected)
        try:
            arrays = arrays_of(case.payload)
        except Exception:  # numpy itself cannot read it: the CLI's part was the test
            return
        model = self._model(case.seed)
        _check_against_reference(model, SEEDS[case.seed]().SerializeToString(), arrays)

    def _call(self, case: Case, folder: str) -> None:
        args = json.loads(case.payload)
        self._model(case.seed)(*args)

    def _records(self, case: Case, folder: str) -> None:
        records = os.path.join(folder, "records")
        os.makedirs(records)
        for name, text in json.loads(case.payload).items():
            _write(records, name, text.encode())
        for action in ("validate", "list", "stats", "best"):
            code = _cli(folder, "records", action, records)
            if code not in (0, 1, 2) or (code == 1 and action != "validate"):
                raise Finding("cli", f"records {action} exited with {code}")
        seed = SEEDS[case.seed]()
        model = gimlet_tvm.build(seed, "llvm", records=records)
        _check_against_reference(model, seed.SerializeToString(), None)

    def _artifact(self, seed: str) -> str:
        return os.path.join(self.workdir, "seeds", f"{seed}.so")

    def _model(self, seed: str):
        if seed not in self._models:
            self._models[seed] = gimlet_tvm.load(self._artifact(seed))
        return self._models[seed]


def _seed_records(path: str) -> None:
    """Records for the records seed's kernels, each scheduled (its loops parallel) with a
    made-up run time: MetaSchedule's own format, without the minute a tuning run takes."""
    target, tasks, _ = extract_tasks(SEEDS[RECORDS_SEED](), "llvm")
    lines = []
    for task in tasks:
        sch = tvm.s_tir.Schedule(task.mod)
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            loops = sch.get_loops(block)
            if len(loops) > 1:
                sch.parallel(loops[0])
        record = ms.database.TuningRecord(sch.trace, ms.database.Workload(task.mod), [1e-5], target,
                                          ms.arg_info.ArgInfo.from_prim_func(task.mod["main"]))
        lines.append((task.workload, record_json(record)))
    RecordsDB(path, create=True).add(lines, {t.workload[0]: {"name": t.name, "weight": t.weight} for t in tasks})


def _write(folder: str, name: str, data: bytes) -> None:
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


def _cli(folder: str, *argv: str) -> int:
    """`gimlet-tvm ARGV` in `folder`, in this process: its exit code; a finding when it raises
    (no exit code) or prints a traceback."""
    err = io.StringIO()
    previous = os.getcwd()
    os.chdir(folder)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = cli_main(list(argv))
    except SystemExit as exit:  # argparse
        code = exit.code if isinstance(exit.code, int) else 2
    except Exception as exc:
        raise Finding("cli", f"gimlet-tvm {' '.join(argv)} raised {type(exc).__name__}: {str(exc)[:500]}") from None
    finally:
        os.chdir(previous)
    if code not in (0, 1, 2) or "Traceback" in err.getvalue():
        raise Finding("cli", f"gimlet-tvm {' '.join(argv)} exited with {code}: {err.getvalue()[-500:]}")
    return code


def _check_files(folder: str, expected: set[str]) -> None:
    extra = sorted(set(os.listdir(folder)) - expected)
    if extra:
        raise Finding("leftover", f"files left behind: {extra}")


def _seed_inputs(seed: str) -> dict[str, np.ndarray]:
    """Inputs for a seed model: symbolic dims 2, indices within range (the tables have 10 rows)."""
    rng = np.random.default_rng(0)
    model = SEEDS[seed]()
    arrays = {}
    for info in model.graph.input:
        tensor_type = info.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 2 for d in tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        if dtype.kind == "f":
            arrays[info.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            arrays[info.name] = rng.integers(0, 2, shape).astype(dtype)
        else:
            arrays[info.name] = rng.integers(0, 10, shape).astype(dtype)
    return arrays


def _check_against_reference(model, onnx_bytes: bytes, inputs: dict | None) -> None:
    """Run `model` (inputs: given, else random for its interface) and compare its outputs with
    onnxruntime's on the same ONNX model; where onnxruntime refuses the model or the inputs,
    our result goes unchecked."""
    if inputs is None:
        sizes = [math.prod(d if isinstance(d, int) else 2 for d in spec.shape) for spec in model.inputs]
        if any(size > MAX_RUN_ELEMENTS or size < 0 for size in sizes):
            return
        inputs = dict(zip(model.input_names, random_inputs(model.io, dims={d: 2 for s in model.inputs
                                                                           for d in s.shape})))
    ours = model.run(inputs)
    try:
        reference = onnxruntime_session(onnx.load_from_string(onnx_bytes), 1).run(None, inputs)
    except Exception:
        return
    for (name, got), want in zip(ours.items(), reference):
        if got.shape != want.shape or got.dtype != want.dtype:
            raise Finding("wrong", f"output {name}: {got.dtype}{list(got.shape)}, onnxruntime "
                                   f"{want.dtype}{list(want.shape)}")
        close = np.isclose(got, want, equal_nan=True, **TOLERANCE)
        if not close.all():
            where = tuple(int(i) for i in np.argwhere(~close)[0])
            raise Finding("wrong", f"output {name}: {int((~close).sum())} of {close.size} elements "
                                   f"differ from onnxruntime's, first at {list(where)}: {got[where]} "
                                   f"against {want[where]}")


def _serve(conn, workdir: str) -> None:
    """The worker's loop: a request is ("prepare",) or ("case", Case); answers go back on `conn`.
    Its stdout and stderr (TVM's C++ log lines too) go to `workdir/worker.log`."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, hard))
    log = os.open(os.path.join(workdir, "worker.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    checker = Checker(workdir)
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request[0] == "prepare":
            conn.send(checker.prepare())
        else:
            conn.send(checker.run(request[1]))


class Worker:
    """A worker process; `run` answers a case's outcome, turning the worker's death into a
    "crash" and its silence past `timeout` into a "hang" (and starting a new worker)."""

    def __init__(self, workdir: str, timeout: float = TIMEOUT):
        self.workdir = workdir
        self.timeout = timeout
        self._process = None
        self._conn = None

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, self.workdir), daemon=True)
        self._process.start()
        child.close()

    def _ask(self, timeout: float):
        if not self._conn.poll(timeout):
            self.close()
            raise TimeoutError
        try:
            return self._conn.recv()
        except (EOFError, ConnectionError):  # the worker died
            self._process.join(5)
            code = self._process.exitcode
            self._process = None
            raise ChildProcessError(_death(code)) from None

    def prepare(self) -> dict[str, str]:
        if self._process is None:
            self._start()
        self._conn.send(("prepare",))
        return self._ask(20 * self.timeout)

    def run(self, case: Case) -> Outcome:
        if self._process is None:
            self._start()
        start = os.path.getsize(self._log()) if os.path.exists(self._log()) else 0
        try:
            self._conn.send(("case", case))
            return self._ask(self.timeout)
        except (BrokenPipeError, ConnectionResetError):  # it died before the case: report that
            self._process.join(5)
            code, self._process = self._process.exitcode, None
            return Outcome("crash", f"{_death(code)}{self._log_tail(start)}")
        except TimeoutError:
            return Outcome("hang", f"no answer within {self.timeout:.0f} s")
        except ChildProcessError as err:
            return Outcome("crash", f"{err}{self._log_tail(start)}")

    def _log(self) -> str:
        return os.path.join(self.workdir, "worker.log")

    def _log_tail(self, start: int = 0) -> str:
        try:
            with open(self._log(), "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace").strip()
        except OSError:
            return ""
        return f"; its last output: {text[-800:]}" if text else ""

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
        self._process = None


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        return f"worker killed by signal {-code}"
    return f"worker exited with code {code}"


# ---- making cases, the corpus, the driver ------------------------------------------------------

def seed_payloads(paths: dict[str, str]) -> dict[str, dict[str, bytes]]:
    """Each stage's unmutated input per seed model."""
    models = {name: make().SerializeToString() for name, make in SEEDS.items()}
    artifacts = {name: Path(paths[name]).read_bytes() for name in SEEDS}
    npz = {name: npz_of(_seed_inputs(name)) for name in SEEDS}
    records = {RECORDS_SEED: json.dumps({f.name: f.read_text() for f in Path(paths["records"]).iterdir()
                                         if not f.name.startswith(".")}).encode()}
    return {"build": models, "compile": models, "load": artifacts, "run": npz, "call": npz,
            "records": records}


def round_cases(seeds: dict[str, dict[str, bytes]], round_index: int, master_seed: int,
                include_known: bool = False) -> list[Case]:
    """One round: every mutator of every stage once, on the seeds in turn (the next one where a
    mutator has nothing to change in a seed)."""
    cases = []
    for stage, mutators in MUTATORS.items():
        names = sorted(seeds[stage])
        for number, (mutator, mutate) in enumerate(mutators.items()):
            rng = np.random.default_rng([master_seed, round_index, len(cases)])
            for shift in range(len(names)):
                seed = names[(round_index + number + shift) % len(names)]
                if (stage, mutator, seed) in KNOWN and not include_known:
                    continue
                payload = mutate(seeds[stage][seed], rng)
                if payload is not None:
                    cases.append(Case(stage, seed, mutator, payload))
                    break
    return cases


def save_finding(corpus: Path, case: Case, outcome: Outcome) -> Path:
    """Save the case's input as `HASH.EXT.gz` (gzipped) and `HASH.case.json` beside it."""
    corpus.mkdir(parents=True, exist_ok=True)
    digest = case.digest()
    path = corpus / f"{digest}{EXTENSIONS[case.stage]}.gz"
    path.write_bytes(gzip.compress(case.payload, mtime=0))
    sidecar = {"stage": case.stage, "seed": case.seed, "mutator": case.mutator,
               "finding": outcome.status, "error": outcome.detail[:2000],
               "found": datetime.date.today().isoformat()}
    (corpus / f"{digest}.case.json").write_text(json.dumps(sidecar, indent=1) + "\n")
    return path


def corpus_cases(corpus: Path) -> list[Case]:
    """Every case saved in `corpus`, in file-name order."""
    cases = []
    for sidecar in sorted(corpus.glob("*.case.json")):
        info = json.loads(sidecar.read_text())
        digest = sidecar.name[: -len(".case.json")]
        payload = gzip.decompress((corpus / f"{digest}{EXTENSIONS[info['stage']]}.gz").read_bytes())
        cases.append(Case(info["stage"], info["seed"], info["mutator"], payload))
    return cases


@dataclasses.dataclass
class Report:
    """Counts of a run's outcomes, and its findings."""

    cases: int = 0
    outcomes: dict[str, int] = dataclasses.field(default_factory=dict)
    findings: list[tuple[Case, Outcome]] = dataclasses.field(default_factory=list)

    signatures: set[str] = dataclasses.field(default_factory=set)

    def add(self, case: Case, outcome: Outcome) -> None:
        self.cases += 1
        self.outcomes[outcome.status] = self.outcomes.get(outcome.status, 0) + 1
        if outcome.finding:
            self.findings.append((case, outcome))
            self.signatures.add(outcome.signature(case))

    def summary(self) -> str:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))
        return (f"{self.cases} cases ({counts}), {len(self.findings)} findings "
                f"({len(self.signatures)} distinct)")


def run_cases(cases: list[Case], worker: Worker, corpus: Path | None = None,
              log: Callable[[str], None] | None = None, report: Report | None = None) -> Report:
    """Run `cases`; findings are saved in `corpus` (when given) and logged as they come."""
    report = report or Report()
    for case in cases:
        outcome = worker.run(case)
        new = outcome.finding and outcome.signature(case) not in report.signatures
        report.add(case, outcome)
        if new:
            saved = f" -> {save_finding(corpus, case, outcome)}" if corpus is not None else ""
            if log is not None:
                log(f"FINDING {case.stage}/{case.mutator} on {case.seed}: {outcome.status}: "
                    f"{outcome.detail[:300]}{saved}")
    return report


def fuzz(minutes: float, seed: int = 0, corpus: Path | None = CORPUS, include_known: bool = False,
         timeout: float = TIMEOUT, log: Callable[[str], None] = print) -> Report:
    """Rounds of cases until `minutes` have passed (the first round runs whole)."""
    deadline = time.monotonic() + minutes * 60
    report = Report()
    with tempfile.TemporaryDirectory(prefix="gimlet-fuzz-") as workdir:
        worker = Worker(workdir, timeout)
        try:
            seeds = seed_payloads(worker.prepare())
            round_index = 0
            while round_index == 0 or time.monotonic() < deadline:
                for case in round_cases(seeds, round_index, seed, include_known):
                    run_cases([case], worker, corpus, log, report)
                    if round_index and time.monotonic() >= deadline:
                        break
                round_index += 1
                log(f"[fuzz {minutes * 60 - (deadline - time.monotonic()):6.0f} s] round "
                    f"{round_index}: {report.summary()}")
        finally:
            worker.close()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to fuzz (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--corpus", type=Path, default=CORPUS, help=f"where findings go (default {CORPUS})")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds a case may take")
    parser.add_argument("--all", action="store_true",
                        help="also the cases whose findings are known and wait for a fix: "
                             + "; ".join(f"{'/'.join(k)} ({why})" for k, why in sorted(KNOWN.items())))
    args = parser.parse_args(argv)
    report = fuzz(args.minutes, args.seed, args.corpus, args.all, args.timeout)
    print(f"done: {report.summary()}")
    for case, outcome in report.findings:
        print(f"  {case.stage}/{case.mutator} on {case.seed}: {outcome.status}: {outcome.detail[:200]}")
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
