"""`gimlet-tvm records ...` through the real console script, on records from a real tuning run."""

from __future__ import annotations

import json
import os

from gimlet_tvm.schedules.tuning.records import RECORD_FILE, WORKLOAD_FILE, RecordsDB

from .test_tuning import records_copy, tuned_records  # noqa: F401  (shared fixtures)


def _append(path: str, text: str) -> None:
    with open(os.path.join(path, RECORD_FILE), "a") as f:
        f.write(text)


def test_list_show_best_stats(cli, tuned_records):
    db = RecordsDB(tuned_records)
    code, out, err = cli("records", "list", tuned_records)
    assert code == 0, err
    for entry in filter(None, db.workloads):
        assert entry.name in out
    assert "llvm" in out and "best ms" in out
    best = db.best()[0]
    name = db.workload(best.workload).name
    code, out, err = cli("records", "show", tuned_records, name)
    assert code == 0, err
    assert f"best {best.seconds * 1e3:.4f} ms" in out and "sch.get_sblock" in out
    code, out, err = cli("records", "show", tuned_records, "no_such_task")
    assert code == 2 and "no task 'no_such_task'" in err
    entry = db.workload(best.workload)
    code, out, err = cli("records", "show", tuned_records, entry.shash[:12])
    assert code == 0 and out.startswith(f"task {entry.index} "), err
    code, out, err = cli("records", "best", tuned_records)
    assert code == 0 and len(out.strip().splitlines()) == 2 + len(db.best())
    code, out, err = cli("records", "stats", tuned_records, "--json")
    stats = json.loads(out)
    assert code == 0 and stats["records"] == len(db.records) and stats["corrupt_lines"] == 0


def test_task_index_before_hash_prefix(records_copy):
    """"1" names task 1, though task 0's structural hash starts with 1 too."""
    path = os.path.join(records_copy, WORKLOAD_FILE)
    with open(path) as f:
        lines = f.read().splitlines()
    assert len(lines) >= 2
    first = json.loads(lines[0])
    first[0] = "1" + str(first[0])
    lines[0] = json.dumps(first)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    db = RecordsDB(records_copy)
    assert db.find_task("1").index == 1 and db.find_task("0").index == 0
    assert db.find_task(str(first[0])[:12]).index == 0


def test_best_merge_prune(cli, records_copy, tmp_path):
    db = RecordsDB(records_copy)
    code, out, err = cli("records", "best", records_copy, "-o", "best")
    assert code == 0, err
    best = RecordsDB(tmp_path / "best")
    assert len(best.records) == len(db.best())
    # Merging a directory with its own best: one record per workload and target, the best.
    code, out, err = cli("records", "merge", records_copy, "best", "-o", "merged")
    assert code == 0, err
    merged = RecordsDB(tmp_path / "merged")
    assert sorted(r.seconds for r in merged.records) == sorted(r.seconds for r in db.best())
    code, out, err = cli("records", "prune", records_copy, "--keep-top", "1")
    assert code == 0, err
    pruned = RecordsDB(records_copy)
    assert len(pruned.records) == len(db.best()) and all(r.seconds for r in pruned.records)
    assert f"removed {len(db.records) - len(pruned.records)} lines" in out


def test_export_import_roundtrip(cli, tuned_records, tmp_path):
    code, out, err = cli("records", "export", tuned_records, "-o", "all.json")
    assert code == 0, err
    code, out, err = cli("records", "import", "all.json", "copy")
    assert code == 0, err
    original, copy = RecordsDB(tuned_records), RecordsDB(tmp_path / "copy")
    assert [r.data for r in copy.records] == [r.data for r in original.records]
    assert [w.name for w in copy.workloads] == [w.name for w in original.workloads]
    code, out, err = cli("records", "import", "all.json", "copy")  # again: all duplicates
    assert code == 0 and "imported 0 new records" in out
    (tmp_path / "bad.json").write_text("{}")
    code, out, err = cli("records", "import", "bad.json", "copy")
    assert code == 2 and "not a gimlet-tvm records export" in err


def test_validate_reports_corrupt_lines_and_loads_the_rest(cli, records_copy):
    good = len(RecordsDB(records_copy).records)
    lines = sum(1 for _ in open(os.path.join(records_copy, RECORD_FILE)))
    _append(records_copy, "this is not json\n")
    _append(records_copy, "[99, []]\n")
    _append(records_copy, '[0, [["torn')  # a writer that crashed mid-line
    code, out, err = cli("records", "validate", records_copy)
    assert code == 1
    assert f"{RECORD_FILE}:{lines + 1}: not a [workload, record] pair" in out
    assert f"{RECORD_FILE}:{lines + 2}: refers to missing or corrupt workload 99" in out
    assert f"note: {os.path.join(records_copy, RECORD_FILE)}:{lines + 3}: unfinished last line" in out
    assert f"{good} records loaded: 2 bad lines" in out
    code, out, err = cli("records", "list", records_copy)  # still usable, with warnings
    assert code == 0 and out.count("warning: skipped") == 2
    # The next writer cuts the torn line off first, so its own line survives intact.
    db = RecordsDB(records_copy)
    record = db.records[0]
    db.add([(db.workload(record.workload).data, [*record.data[:1], [1e-3], *record.data[2:]])], dedupe=False)
    after = RecordsDB(records_copy)
    assert len(after.records) == good + 1 and len(after.problems) == 2 and not after.unfinished
    with open(os.path.join(records_copy, WORKLOAD_FILE), "a") as f:
        f.write("garbage\n")
    code, out, err = cli("records", "validate", records_copy)
    assert code == 1 and f"{WORKLOAD_FILE}:" in out and "not a workload" in out


def test_plot_writes_a_png(cli, tuned_records, tmp_path):
    code, out, err = cli("records", "plot", tuned_records, "-o", "curve.png")
    assert code == 0, err
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_layout_transform_record_is_stored_and_read_back(tmp_path):
    """A trace with an index map (MetaSchedule's layout rewrites) is stored as JSONDatabase
    stores it, and both our reader and upstream's replay it to the same schedule."""
    import tvm
    from tvm import s_tir, te
    from tvm.s_tir import meta_schedule as ms

    from gimlet_tvm.schedules.tuning.records import record_json

    a = te.placeholder((16, 16), name="A")
    mod = tvm.IRModule({"main": te.create_prim_func([a, te.compute((16, 16), lambda i, j: a[i, j] + 1.0)])})
    sch = s_tir.Schedule(mod)
    sch.transform_layout(sch.get_sblock("compute"), ("read", 0), lambda i, j: (j, i))
    target = tvm.target.Target({"kind": "llvm"})
    record = ms.database.TuningRecord(sch.trace, ms.database.Workload(mod), [1e-3], target,
                                      ms.arg_info.ArgInfo.from_prim_func(mod["main"]))
    db = RecordsDB(tmp_path, create=True)
    assert db.add([(ms.database.Workload(mod), record_json(record))]) == 1
    for database in (RecordsDB(tmp_path).database(target), ms.database.JSONDatabase(work_dir=str(tmp_path))):
        (best,) = database.get_top_k(database.commit_workload(mod), 1)
        replayed = s_tir.Schedule(mod)
        best.trace.apply_to_schedule(replayed, remove_postproc=False)
        tvm.ir.assert_structural_equal(replayed.mod, sch.mod)
