"""Concurrent and killed writers of a records directory: many processes appending at once, a
writer killed with SIGKILL mid-write, and the same with real `gimlet-tvm tune` processes. After
each, `records validate` passes and every record a writer reported finished is there."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import time

import onnx
import pytest
import tvm
from tvm import s_tir, te
from tvm.s_tir import meta_schedule as ms

from gimlet_tvm.schedules.tuning.records import RECORD_FILE, WORKLOAD_FILE, RecordsDB, record_json

from .records_writer import make_batch, tag, write_batches
from .test_tuning import tiny_model

CONTEXT = multiprocessing.get_context("spawn")
BIG = 200  # records in a killed writer's batch: one write of about 80 kB (20 pages)


def _entry() -> tuple[list, list]:
    """A real workload and record as JSON (a split loop: a trace with a few steps)."""
    a = te.placeholder((64, 64), name="A")
    mod = tvm.IRModule({"main": te.create_prim_func([a, te.compute((64, 64), lambda i, j: a[i, j] * 2.0)])})
    sch = s_tir.Schedule(mod)
    i, j = sch.get_loops(sch.get_sblock("compute"))
    sch.split(i, [None, 8])
    sch.split(j, [None, 16])
    record = ms.database.TuningRecord(sch.trace, ms.database.Workload(mod), [1e-3],
                                      tvm.target.Target({"kind": "llvm"}),
                                      ms.arg_info.ArgInfo.from_prim_func(mod["main"]))
    return ms.database.Workload(mod).as_json(), record_json(record)


def _validate(cli, path: str) -> str:
    code, out, err = cli("records", "validate", path)
    assert code == 0 and "records loaded: ok" in out, out + err
    return out


def test_many_processes_append_without_losing_or_mixing_lines(cli, tmp_path):
    """Four processes append 10 batches of 25 records each at once: every record is there
    once, and each batch's lines are together and in order (one locked write per batch)."""
    path, writers, batches, size = str(tmp_path / "shared"), 4, 10, 25
    RecordsDB(path, create=True)
    entry = _entry()
    procs = [CONTEXT.Process(target=write_batches, args=(path, entry, w, batches, size)) for w in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    _validate(cli, path)
    db = RecordsDB(path)
    tags = [tag(r) for r in db.records]
    assert sorted(tags) == [(w, b, i) for w in range(writers) for b in range(batches) for i in range(size)]
    runs = [tags[k:k + size] for k in range(0, len(tags), size)]
    assert all(run == [(run[0][0], run[0][1], i) for i in range(size)] for run in runs)
    assert len(db.workloads) == 1 and not db.unfinished


def test_an_unfinished_last_line_is_set_aside_and_cut_off_by_the_next_writer(cli, tmp_path):
    """What a writer killed mid-line leaves: validate notes it and passes, the records before
    it load, and the next append removes it rather than gluing its own line onto it."""
    path = str(tmp_path / "records")
    db = RecordsDB(path, create=True)
    entry = _entry()
    db.add(make_batch(entry, 0, 0, 3), dedupe=False)
    records = os.path.join(path, RECORD_FILE)
    with open(records, "rb") as f:
        whole = f.read()
    with open(records, "ab") as f:
        f.write(whole.splitlines(keepends=True)[0][:57])  # a record line cut short
    out = _validate(cli, path)
    assert f"note: {records}:4: unfinished last line (57 bytes, no newline)" in out
    assert "3 records loaded: ok" in out
    db = RecordsDB(path)
    assert len(db.records) == 3 and not db.problems and len(db.unfinished) == 1
    db.add(make_batch(entry, 0, 1, 2), dedupe=False)
    with open(records, "rb") as f:
        after = f.read()
    assert after.startswith(whole) and after.count(b"\n") == 5 and after.endswith(b"\n")
    assert [tag(r)[1] for r in RecordsDB(path).records] == [0, 0, 0, 1, 1]
    # A workload line cut short: the workload indices the records use stay right.
    with open(os.path.join(path, WORKLOAD_FILE), "ab") as f:
        f.write(b'["12345", "AAAA')
    db = RecordsDB(path)
    assert len(db.workloads) == 1 and len(db.records) == 5 and not db.problems
    other = _entry()
    other[0][0] = "999"  # a second workload, appended after the cut-off fragment
    db.add([(other[0], entry[1])], dedupe=False)
    db = RecordsDB(path)
    assert [w.shash for w in db.workloads] == [entry[0][0], "999"] and db.records[-1].workload == 1
    assert not db.problems and not db.unfinished


def _kill_during_writes(path: str, entry, writer: int, on_growth: bool) -> int:
    """Start a writer of large batches, kill it with SIGKILL after a few reported batches (as
    soon as the file grows again, or at a random moment); the batches it reported finished."""
    ours, theirs = CONTEXT.Pipe(duplex=False)
    proc = CONTEXT.Process(target=write_batches, args=(path, entry, writer, 10_000, BIG, theirs))
    proc.start()
    theirs.close()
    finished = 0
    while finished < 1:  # a finished batch, so there is something to lose
        assert ours.poll(240), "the writer reported no batch"
        finished = ours.recv() + 1
    records = os.path.join(path, RECORD_FILE)
    if on_growth:
        size = os.path.getsize(records)
        deadline = time.monotonic() + 60
        while os.path.getsize(records) == size and time.monotonic() < deadline:
            pass
    else:
        time.sleep(random.uniform(0, 1.0))
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    with contextlib.suppress(EOFError):  # reports sent before the kill, then the closed pipe
        while ours.poll():
            finished = ours.recv() + 1
    return finished


def test_a_writer_killed_mid_write_loses_no_finished_batch(cli, tmp_path):
    """Four writers killed with SIGKILL, two as their append began, two at random moments: each
    batch a writer reported finished is there whole, and the directory validates throughout."""
    path = str(tmp_path / "records")
    RecordsDB(path, create=True)
    entry = _entry()
    finished, cut = {}, 0
    for writer in range(4):
        finished[writer] = _kill_during_writes(path, entry, writer, on_growth=writer % 2 == 0)
        db = RecordsDB(path)
        assert not db.problems
        cut += len(db.unfinished)
        tags = {tag(r) for r in db.records}
        for w, batches in finished.items():
            assert {(w, b, i) for b in range(batches) for i in range(BIG)} <= tags
    print(f"killed 4 writers; {cut} left an unfinished line")
    _validate(cli, path)
    db = RecordsDB(path)
    before = len(db.records)
    db.add(make_batch(entry, 9, 0, 5), dedupe=False)
    db = RecordsDB(path)
    assert len(db.records) == before + 5 and not db.unfinished and not db.problems


# ---- real `gimlet-tvm tune` processes ----------------------------------------------------

TUNE = ["--trials-per-round", "4", "--population", "16", "--no-select", "-t", "llvm"]


def _tune(tmp_path, records: str, trials: int, seed: int) -> subprocess.Popen:
    model = tmp_path / "tiny.onnx"
    if not model.exists():
        onnx.save(tiny_model(), model)
    script = os.path.join(os.path.dirname(sys.executable), "gimlet-tvm")
    return subprocess.Popen(
        [script, "tune", str(model), "--records", records, "--trials", str(trials),
         "--seed", str(seed), *TUNE],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        start_new_session=True,  # its own process group: the builder and runner workers too
    )


def _ran(proc: subprocess.Popen) -> int:
    """The trials a finished tune reported running."""
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    return int(re.search(r"ran (\d+) trials", out)[1])


@pytest.mark.slow
def test_two_tune_processes_share_a_records_directory(cli, tmp_path):
    records = str(tmp_path / "records")
    procs = [_tune(tmp_path, records, 8, seed) for seed in (1, 2)]
    ran = [_ran(p) for p in procs]
    _validate(cli, records)
    db = RecordsDB(records)
    assert sum(ran) >= 8 and len(db.records) == sum(ran), (ran, len(db.records))
    assert len({w.shash for w in db.workloads if w}) == len(db.workloads)  # each kernel once


@pytest.mark.slow
def test_a_tune_killed_mid_write_keeps_its_records_and_resumes(cli, tmp_path):
    records = str(tmp_path / "records")
    proc = _tune(tmp_path, records, 400, 0)
    reported = 0
    for line in proc.stderr:  # progress: one line after each round's records were written
        match = re.search(r"run (\d+)/400 trials", line)
        if match and int(match[1]) >= 4:
            reported = int(match[1])
            break
    assert reported, "tune reported no round"
    path = os.path.join(records, RECORD_FILE)
    size, deadline = os.path.getsize(path), time.monotonic() + 60
    while os.path.getsize(path) == size and time.monotonic() < deadline:
        pass  # kill as the next round's append begins
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    _validate(cli, records)
    db = RecordsDB(records)
    assert len(db.records) >= reported and not db.problems
    before = len(db.records)
    resumed = _tune(tmp_path, records, before + 4, 3)
    ran = _ran(resumed)
    out = _validate(cli, records)
    db = RecordsDB(records)
    assert ran >= 4 and len(db.records) == before + ran and not db.unfinished, out
