"""Tuning records: MetaSchedule's JSON database, read tolerantly and written safely.

A records directory holds MetaSchedule's own two JSON-lines files, so upstream TVM
(`ms.database.JSONDatabase(work_dir=DIR)`) reads ours and we read theirs:

- `database_workload.json`: one workload a line, `[structural hash, base64 IRModule]`;
- `database_tuning_record.json`: one measurement a line, `[workload line index, record]`,
  the record being `record_json(record)`: `[trace, run seconds, target, args info]`.

Next to them, `gimlet_tasks.json` (ignored by upstream) names each workload's task and its
weight (calls per model run), which the CLI shows and the model-latency estimate uses.

Safety: writers append whole lines under an exclusive `fcntl` lock on `DIR/.lock`, each batch
with one write (repeated only for what a short write left) and an fsync; rewrites go to a
temporary file renamed into place. So several processes may tune into one directory at once.
A writer killed mid-write (SIGKILL, power loss) can leave only an unfinished last line: every
line ends with its newline, so the reader sets a last line without one aside as `unfinished`
(not a record, not a problem: it was never finished; a reader without the lock may also catch a
live writer's line half-written), and the next writer cuts it off under the lock before
appending. The reader parses every line on its own: a corrupt line becomes a `Problem` naming
its file and line number and the rest still loads.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import tvm
from tvm import relax
from tvm.s_tir import meta_schedule as ms

from ...errors import GimletError, summary
from ...files import atomic_path

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
TASKS_FILE = "gimlet_tasks.json"
LOCK_FILE = ".lock"
# MetaSchedule's AddToDatabase stores a failed build or run as this many seconds.
FAILED_SECONDS = 1e10
EXPORT_FORMAT = "gimlet-tvm-records/1"


@dataclass(frozen=True)
class Problem:
    """A line that could not be used."""

    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


@dataclass
class Workload:
    """One line of the workload file: a kernel (TIR IRModule) that records are made for."""

    index: int
    line: int
    data: list
    workload: ms.database.Workload
    name: str = ""
    weight: int = 1

    @property
    def shash(self) -> str:
        return str(self.data[0])


@dataclass
class Record:
    """One line of the tuning-record file: a measured schedule of one workload."""

    line: int
    workload: int
    data: list
    seconds: float | None  # mean run time; None when the build or run failed

    @property
    def target(self) -> str:
        """The target the record was measured on, as compact JSON (a stable key)."""
        return json.dumps(self.data[2], sort_keys=True, separators=(",", ":"))

    @property
    def trace(self) -> str:
        return json.dumps(self.data[0], separators=(",", ":"))


def _mean_seconds(run_secs: Any) -> float | None:
    if not isinstance(run_secs, list) or not run_secs:
        return None
    values = [float(v) for v in run_secs]
    if any(not math.isfinite(v) or v <= 0 or v >= FAILED_SECONDS / 10 for v in values):
        return None
    return sum(values) / len(values)


def record_json(record: ms.database.TuningRecord) -> Any:
    """A tuning record as JSON, as MetaSchedule's `JSONDatabase` writes it. Not
    `TuningRecord.as_json()`: that fails on a trace holding an index map (a layout transform),
    which the database stores as its `tvm.ir.save_json` text."""

    def plain(obj: Any) -> Any:
        if isinstance(obj, (tvm.tirx.IntImm, tvm.tirx.FloatImm)):
            return obj.value
        if isinstance(obj, tvm.tirx.IndexMap):
            return tvm.ir.save_json(obj)
        if isinstance(obj, tvm.ir.Array):
            return [plain(item) for item in obj]
        if isinstance(obj, tvm.ir.Map):
            return {plain(key): plain(value) for key, value in obj.items()}
        if isinstance(obj, str):
            return str(obj)
        if obj is None or isinstance(obj, (int, float)):
            return obj
        raise TypeError(f"a tuning record holds {type(obj).__name__}, which has no JSON form")

    return plain(tvm.get_global_func("s_tir.meta_schedule.TuningRecordAsJSON")(record))


def _line(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":")) + "\n"


def target_key(target: tvm.target.Target) -> str:
    """Key matching records to a build target: the kind and CPU model (cores may differ)."""
    config = dict(target.export())
    return f"{config.get('kind')}:{config.get('mcpu', '')}"


def _record_target_key(record: Record) -> str:
    config = record.data[2] if isinstance(record.data[2], dict) else {}
    return f"{config.get('kind')}:{config.get('mcpu', '')}"


class RecordsDB:
    """A records directory, loaded into memory; the lines that failed to load are `problems`."""

    def __init__(self, path: str | os.PathLike, *, create: bool = False) -> None:
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            if not create:
                raise GimletError(f"records directory not found: {self.path}")
            os.makedirs(self.path, exist_ok=True)
        self.workloads: list[Workload | None] = []
        self.records: list[Record] = []
        self.problems: list[Problem] = []
        # Last lines a writer had not finished (module docstring): neither records nor problems.
        self.unfinished: list[Problem] = []
        self.load()

    # ---- reading -------------------------------------------------------------------------
    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _lines(self, name: str) -> Iterator[tuple[int, str]]:
        """(line number, text) of the finished non-empty lines; MetaSchedule indexes workloads
        by these. A last line without its newline goes to `unfinished` instead."""
        path = self._file(name)
        if not os.path.exists(path):
            return
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if not raw.endswith(b"\n"):
                    self.unfinished.append(
                        Problem(name, number, f"unfinished last line ({len(raw)} bytes, no newline)"))
                    return
                text = raw.decode("utf-8", errors="replace").strip()
                if text:
                    yield number, text

    def load(self, check: bool = True) -> None:
        """(Re)read both files and the task names; corrupt lines go to `problems`.

        `check` also parses each record's trace (what `validate` reports); writers skip it.
        """
        self.workloads, self.records, self.problems, self.unfinished = [], [], [], []
        for number, text in self._lines(WORKLOAD_FILE):
            self.workloads.append(self._parse_workload(len(self.workloads), number, text))
        tasks = self._read_tasks()
        for entry in self.workloads:
            if entry is not None:
                info = tasks.get(entry.shash, {})
                entry.name = f"workload{entry.index}"
                if not isinstance(info, dict) or not isinstance(info.get("name", ""), str) or \
                        not isinstance(info.get("weight", 1), int) or info.get("weight", 1) < 1:
                    self._problem(TASKS_FILE, 1, f"task {entry.shash}: not a name and a weight (a "
                                                 f"count of at least 1): {json.dumps(info)[:100]}")
                    continue
                entry.name = info.get("name") or entry.name
                entry.weight = info.get("weight", 1)
        for number, text in self._lines(RECORD_FILE):
            record = self._parse_record(number, text, check)
            if record is not None:
                self.records.append(record)

    def _problem(self, file: str, line: int, message: str) -> None:
        self.problems.append(Problem(file, line, message))

    def _parse_workload(self, index: int, number: int, text: str) -> Workload | None:
        try:
            data = json.loads(text)
            workload = ms.database.Workload.from_json(data)
        except Exception as err:  # json errors and TVM's deserialisation errors alike
            self._problem(WORKLOAD_FILE, number, f"not a workload: {summary(err)}")
            return None
        return Workload(index, number, data, workload)

    def _parse_record(self, number: int, text: str, check: bool) -> Record | None:
        try:
            index, data = json.loads(text)
        except (ValueError, TypeError) as err:
            self._problem(RECORD_FILE, number, f"not a [workload, record] pair: {summary(err)}")
            return None
        known = isinstance(index, int) and 0 <= index < len(self.workloads)
        entry = self.workloads[index] if known else None
        if entry is None:
            self._problem(RECORD_FILE, number, f"refers to missing or corrupt workload {index}")
            return None
        try:
            if check:
                ms.database.TuningRecord.from_json(data, entry.workload)
        except Exception as err:
            self._problem(RECORD_FILE, number, f"not a tuning record: {summary(err)}")
            return None
        return Record(number, index, data, _mean_seconds(data[1]))

    def _read_tasks(self) -> dict[str, dict]:
        path = self._file(TASKS_FILE)
        if not os.path.exists(path):
            return {}
        try:
            with open(path) as f:
                tasks = json.load(f)
            return tasks if isinstance(tasks, dict) else {}
        except ValueError as err:
            self._problem(TASKS_FILE, 1, f"not JSON: {summary(err)}")
            return {}

    # ---- queries -------------------------------------------------------------------------
    def workload(self, index: int) -> Workload:
        entry = self.workloads[index]
        assert entry is not None
        return entry

    def find_task(self, key: str) -> Workload:
        """A workload by index or task name, else by a prefix of one structural hash alone
        (an index such as "1" is also the prefix of many hashes: the index wins)."""
        entries = [w for w in self.workloads if w is not None]
        for entry in entries:
            if key in (str(entry.index), entry.name):
                return entry
        by_hash = [w for w in entries if w.shash.startswith(key)]
        if len(by_hash) == 1:
            return by_hash[0]
        names = ", ".join(f"{w.index}:{w.name}" for w in (by_hash or entries)) or "none"
        problem = "more than one task's hash starts with" if by_hash else "no task"
        raise GimletError(f"{problem} '{key}' in {self.path} (tasks: {names})")

    def records_of(self, workload: int) -> list[Record]:
        return [r for r in self.records if r.workload == workload]

    def best(self, target: tvm.target.Target | None = None) -> list[Record]:
        """The fastest valid record per (workload, target), in workload order.

        With `target`, only records for its kind and CPU model, one per workload.
        """
        best: dict[tuple[int, str], Record] = {}
        for record in self.records:
            if record.seconds is None:
                continue
            if target is not None and _record_target_key(record) != target_key(target):
                continue
            key = (record.workload, "" if target is not None else record.target)
            if key not in best or record.seconds < best[key].seconds:
                best[key] = record
        return sorted(best.values(), key=lambda r: (r.workload, r.target))

    def progress(self, shash: str, target: tvm.target.Target) -> tuple[int, float | None]:
        """(trials, best seconds) recorded for a workload on `target`'s kind and CPU model."""
        index = next((w.index for w in self.workloads if w is not None and w.shash == shash), -1)
        done = [r for r in self.records_of(index) if _record_target_key(r) == target_key(target)]
        return len(done), min((r.seconds for r in done if r.seconds is not None), default=None)

    def tuning_record(self, record: Record) -> ms.database.TuningRecord:
        return ms.database.TuningRecord.from_json(record.data, self.workload(record.workload).workload)

    def database(self, target: tvm.target.Target, best_only: bool = True) -> ms.database.Database:
        """An in-memory MetaSchedule database of `target`'s valid records (the best per workload)."""
        database = ms.database.MemoryDatabase()
        chosen = self.best(target) if best_only else [
            r for r in self.records
            if r.seconds is not None and _record_target_key(r) == target_key(target)
        ]
        for record in chosen:
            workload = database.commit_workload(self.workload(record.workload).workload.mod)
            tuned = self.tuning_record(record)
            database.commit_tuning_record(
                ms.database.TuningRecord(
                    tuned.trace, workload, tuned.run_secs, tuned.target, tuned.args_info
                )
            )
        return database

    # ---- writing -------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive lock on the directory across processes; reloads the files first."""
        with open(self._file(LOCK_FILE), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self.load(check=False)
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _append(self, name: str, lines: Iterable[str]) -> None:
        """Append whole lines in one write and sync them; the caller holds the lock. An
        unfinished last line (a killed writer's) is cut off first; a failed write (a full disk)
        is cut back off, so no half line is left behind by a live writer either."""
        data = "".join(lines).encode()
        if not data:
            return
        fd = os.open(self._file(name), os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            size = _finished_size(fd)
            os.ftruncate(fd, size)
            try:
                written = 0
                while written < len(data):
                    written += os.write(fd, data[written:])
                os.fsync(fd)
            except BaseException:
                os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)

    def add(
        self,
        records: Iterable[tuple[ms.database.Workload | list, list]],
        tasks: dict[str, dict] | None = None,
        *,
        dedupe: bool = True,
    ) -> int:
        """Append `(workload, record JSON)` pairs under the lock; returns how many were added.

        A workload is a MetaSchedule `Workload` or its JSON; workloads are matched by
        structural hash. With `dedupe`, records already present (same workload, trace and
        target) are skipped; tuning keeps every measurement, as MetaSchedule does.
        `tasks` updates the task names and weights, keyed by structural hash.
        """
        with self.locked():
            index = {w.shash: w.index for w in self.workloads if w is not None}
            present = {(r.workload, r.trace, r.target) for r in self.records}
            new_workloads, new_records = [], []
            count = len(self.workloads)
            for workload, data in records:
                wdata = workload.as_json() if isinstance(workload, ms.database.Workload) else workload
                shash = str(wdata[0])
                if shash not in index:
                    index[shash] = count
                    count += 1
                    new_workloads.append(_line(wdata))
                record = Record(0, index[shash], data, None)
                key = (record.workload, record.trace, record.target)
                if not dedupe or key not in present:
                    present.add(key)
                    new_records.append(_line([record.workload, data]))
            self._append(WORKLOAD_FILE, new_workloads)
            self._append(RECORD_FILE, new_records)
            if tasks:
                merged = self._read_tasks()
                merged.update(tasks)
                _write_atomic(self._file(TASKS_FILE), json.dumps(merged, indent=1, sort_keys=True))
            self.load()
        return len(new_records)

    def keep(self, records: Iterable[Record]) -> None:
        """Rewrite the record file with only `records` (atomically); the caller holds the lock."""
        _write_atomic(
            self._file(RECORD_FILE), "".join(_line([r.workload, r.data]) for r in records)
        )
        self.load()

    def entries(self, records: Iterable[Record]) -> list[tuple[list, list]]:
        """`(workload JSON, record JSON)` pairs, the form `add` and the export file take."""
        return [(self.workload(r.workload).data, r.data) for r in records]

    def task_info(self) -> dict[str, dict]:
        return {w.shash: {"name": w.name, "weight": w.weight} for w in self.workloads if w}

    # ---- maintenance ---------------------------------------------------------------------
    def prune(self, keep_top: int) -> int:
        """Keep the `keep_top` fastest valid records per (workload, target); returns how many
        lines went (failed and corrupt ones included)."""
        with self.locked():
            groups: dict[tuple[int, str], list[Record]] = {}
            for record in self.records:
                if record.seconds is not None:
                    groups.setdefault((record.workload, record.target), []).append(record)
            kept = sorted(
                (r for g in groups.values() for r in sorted(g, key=lambda r: r.seconds)[:keep_top]),
                key=lambda r: r.line,
            )
            lines = sum(1 for _ in self._lines(RECORD_FILE))
            self.keep(kept)
        return lines - len(kept)

    def export(self, path: str) -> int:
        """Write every valid-or-failed record with its workload and task info to one JSON file."""
        portable = {
            "format": EXPORT_FORMAT,
            "tasks": self.task_info(),
            "entries": self.entries(self.records),
        }
        _write_atomic(os.path.abspath(path), json.dumps(portable, separators=(",", ":")))
        return len(self.records)

    def import_file(self, path: str) -> int:
        """Add the records of an `export` file; returns how many were new."""
        try:
            with open(path) as f:
                portable = json.load(f)
        except (OSError, ValueError) as err:
            raise GimletError(f"cannot read records file {path}: {summary(err)}") from None
        if not isinstance(portable, dict) or portable.get("format") != EXPORT_FORMAT:
            raise GimletError(f"{path} is not a gimlet-tvm records export ({EXPORT_FORMAT})")
        return self.add(
            [tuple(entry) for entry in portable.get("entries", [])], portable.get("tasks") or {}
        )

    def stats(self) -> dict[str, Any]:
        """Counts, targets and the per-task speed-up of the best record over the first."""
        valid = [r for r in self.records if r.seconds is not None]
        speedups = {}
        for entry in filter(None, self.workloads):
            times = [r.seconds for r in self.records_of(entry.index) if r.seconds is not None]
            if times:
                speedups[entry.name] = times[0] / min(times)
        targets: dict[str, int] = {}
        for record in self.records:
            key = _record_target_key(record)
            targets[key] = targets.get(key, 0) + 1
        return {
            "workloads": sum(1 for w in self.workloads if w is not None),
            "records": len(self.records),
            "valid": len(valid),
            "failed": len(self.records) - len(valid),
            "corrupt_lines": len(self.problems),
            "targets": targets,
            "speedup_best_over_first": speedups,
        }

    def curves(self) -> tuple[dict[str, list[tuple[int, float]]], list[tuple[int, float]]]:
        """Tuning curves in measurement (file) order: per task, (trial, best seconds so far);
        for the model, (trial over all tasks, sum of weight x best so far) once every task
        has a valid measurement."""
        per_task: dict[str, list[tuple[int, float]]] = {}
        best: dict[int, float] = {}
        model: list[tuple[int, float]] = []
        tasks = {w.index for w in self.workloads if w is not None}
        trials: dict[int, int] = {}
        for number, record in enumerate(self.records, start=1):
            trials[record.workload] = trials.get(record.workload, 0) + 1
            if record.seconds is not None:
                best[record.workload] = min(best.get(record.workload, math.inf), record.seconds)
            if record.workload in best:
                name = self.workload(record.workload).name
                per_task.setdefault(name, []).append((trials[record.workload], best[record.workload]))
            if set(best) >= tasks:
                model.append((number, sum(self.workload(i).weight * t for i, t in best.items())))
        return per_task, model


def merge(sources: Iterable[RecordsDB], output: str) -> RecordsDB:
    """A records directory holding the best record per (workload, target) of all `sources`;
    records are matched by structural hash, so the same kernel tuned twice keeps its best."""
    best: dict[tuple[str, str], tuple[float, list, list]] = {}
    tasks: dict[str, dict] = {}
    for db in sources:
        tasks.update(db.task_info())
        for record in db.best():
            workload = db.workload(record.workload)
            key = (workload.shash, record.target)
            if key not in best or record.seconds < best[key][0]:
                best[key] = (record.seconds, workload.data, record.data)
    result = RecordsDB(output, create=True)
    result.add([(w, r) for _, w, r in best.values()], tasks)
    return result


def _finished_size(fd: int, chunk: int = 1 << 16) -> int:
    """The size of the file up to and with its last newline: where its finished lines end."""
    end = os.fstat(fd).st_size
    while end > 0:
        start = max(0, end - chunk)
        block = os.pread(fd, end - start, start)
        newline = block.rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


def _write_atomic(path: str, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)



@tvm.transform.module_pass(opt_level=0, name="gimlet_tvm.ApplyRecords")
class ApplyRecords:
    """Schedule the kernels that have tuning records (MetaScheduleApplyDatabase); `applied`
    counts them after the pass ran. Kernels without a record are left to the default rules."""

    def __init__(self, records: RecordsDB, target: tvm.target.Target) -> None:
        self.database = records.database(target)
        self.applied = 0

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        before = _scheduled(mod)
        with self.database:
            mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
        self.applied = len(_scheduled(mod) - before)
        return mod


def _scheduled(mod: tvm.IRModule) -> set[str]:
    return {
        gv.name_hint
        for gv, func in mod.functions.items()
        if isinstance(func, tvm.tirx.PrimFunc) and func.attrs and func.attrs.get("tirx.is_scheduled")
    }
