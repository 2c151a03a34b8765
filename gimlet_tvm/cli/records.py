"""`gimlet-tvm records ...`: inspect and maintain tuning-records directories.

The logic lives in `gimlet_tvm.schedules.tuning.records` (`RecordsDB`); this module formats it.
"""

from __future__ import annotations

import json
import os

from ..errors import GimletError
from ..schedules.tuning.records import RecordsDB, merge
from .common import format_table


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.4f}" if seconds is not None else "-"


def _target(record) -> str:
    config = record.data[2] if isinstance(record.data[2], dict) else {}
    return f"{config.get('kind', '?')} {config.get('mcpu', '')}".strip()


def _report_problems(db: RecordsDB) -> None:
    for problem in db.problems:
        print(f"warning: skipped {os.path.join(db.path, problem.file)}:{problem.line}: "
              f"{problem.message}")


def cmd_list(args) -> int:
    db = RecordsDB(args.dir)
    _report_problems(db)
    rows = []
    for entry in filter(None, db.workloads):
        records = db.records_of(entry.index)
        valid = [r for r in records if r.seconds is not None]
        best = min(valid, key=lambda r: r.seconds, default=None)
        rows.append([
            str(entry.index), entry.name, str(entry.weight), str(len(records)),
            str(len(records) - len(valid)), _ms(best.seconds if best else None),
            _target(best or records[0]) if records else "-",
        ])
    print(format_table(["#", "task", "weight", "trials", "failed", "best ms", "target"], rows))
    return 0


def cmd_show(args) -> int:
    db = RecordsDB(args.dir)
    entry = db.find_task(args.task)
    valid = sorted((r for r in db.records_of(entry.index) if r.seconds is not None),
                   key=lambda r: r.seconds)
    if not valid:
        raise GimletError(f"task {entry.name} has no successful record in {args.dir}")
    best = valid[0]
    print(f"task {entry.index} {entry.name} (weight {entry.weight}, workload {entry.shash})")
    print(f"best {_ms(best.seconds)} ms on {_target(best)} "
          f"(line {best.line}; {len(valid)} successful records)")
    print("schedule trace:")
    print(str(db.tuning_record(best).trace))
    return 0


def cmd_best(args) -> int:
    db = RecordsDB(args.dir)
    _report_problems(db)
    best = db.best()
    rows = [[str(r.workload), db.workload(r.workload).name, _ms(r.seconds), _target(r)]
            for r in best]
    print(format_table(["#", "task", "best ms", "target"], rows))
    if args.output:
        out = RecordsDB(args.output, create=True)
        added = out.add(db.entries(best), db.task_info())
        print(f"wrote {added} records to {args.output}")
    return 0


def cmd_merge(args) -> int:
    sources = [RecordsDB(path) for path in args.sources]
    for db in sources:
        _report_problems(db)
    result = merge(sources, args.output)
    print(f"merged {sum(len(db.records) for db in sources)} records from "
          f"{len(sources)} directories into {len(result.records)} (best per workload and "
          f"target) -> {args.output}")
    return 0


def cmd_prune(args) -> int:
    if args.keep_top < 1:
        raise GimletError(f"--keep-top must be at least 1, got {args.keep_top}")
    db = RecordsDB(args.dir)
    removed = db.prune(args.keep_top)
    print(f"removed {removed} lines, kept {len(db.records)} records "
          f"(top {args.keep_top} per workload and target)")
    return 0


def cmd_export(args) -> int:
    db = RecordsDB(args.dir)
    _report_problems(db)
    count = db.export(args.output)
    print(f"exported {count} records of {len(db.task_info())} tasks -> {args.output}")
    return 0


def cmd_import(args) -> int:
    db = RecordsDB(args.dir, create=True)
    added = db.import_file(args.file)
    print(f"imported {added} new records into {args.dir} ({len(db.records)} in all)")
    return 0


def cmd_validate(args) -> int:
    db = RecordsDB(args.dir)
    for problem in db.problems:
        print(f"{os.path.join(db.path, problem.file)}:{problem.line}: {problem.message}")
    for line in db.unfinished:  # a writer killed mid-line, or one writing now: not an error
        print(f"note: {os.path.join(db.path, line.file)}:{line.line}: {line.message}: a write "
              "that never finished, ignored (the next write removes it)")
    workloads = sum(1 for w in db.workloads if w is not None)
    verdict = f"{len(db.problems)} bad lines" if db.problems else "ok"
    print(f"{workloads} workloads, {len(db.records)} records loaded: {verdict}")
    return 1 if db.problems else 0


def cmd_stats(args) -> int:
    db = RecordsDB(args.dir)
    stats = db.stats()
    if args.json:
        print(json.dumps(stats, indent=1))
        return 0
    for key in ("workloads", "records", "valid", "failed", "corrupt_lines"):
        print(f"{key:14} {stats[key]}")
    for target, count in stats["targets"].items():
        print(f"target         {target}: {count} records")
    for task, speedup in stats["speedup_best_over_first"].items():
        print(f"speed-up       {task}: {speedup:.2f}x (best over first measured)")
    return 0


def cmd_plot(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    db = RecordsDB(args.dir)
    per_task, model = db.curves()
    if not per_task:
        raise GimletError(f"no successful records to plot in {args.dir}")
    fig, (tasks_ax, model_ax) = plt.subplots(1, 2, figsize=(13, 5))
    for name, points in per_task.items():
        tasks_ax.step(*zip(*[(n, s * 1e3) for n, s in points]), where="post", label=name[:40])
    tasks_ax.set(xlabel="trials of the task", ylabel="best latency (ms)", yscale="log",
                 title="per task")
    tasks_ax.legend(fontsize=6)
    if model:
        model_ax.step(*zip(*[(n, s * 1e3) for n, s in model]), where="post")
    model_ax.set(xlabel="trials (all tasks)", ylabel="sum of weight x best (ms)",
                 title="model (tuned kernels)")
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    print(f"plotted {len(per_task)} tasks, {len(db.records)} records -> {args.output}")
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("records", help="inspect and maintain tuning records")
    commands = parser.add_subparsers(dest="records_command", required=True, metavar="ACTION")

    def action(name: str, handler, help: str, *, directory: bool = True):
        p = commands.add_parser(name, help=help)
        if directory:
            p.add_argument("dir", help="records directory")
        p.set_defaults(handler=handler)
        return p

    action("list", cmd_list, "tasks, trials, best latency, target")
    action("show", cmd_show, "a task's best schedule trace and latency").add_argument(
        "task", help="task index, name or workload-hash prefix")
    action("best", cmd_best, "one record per workload").add_argument(
        "-o", "--output", help="also write those records to this directory")
    merge_parser = action("merge", cmd_merge, "merge directories, best per workload and target",
                          directory=False)
    merge_parser.add_argument("sources", nargs="+", help="records directories")
    merge_parser.add_argument("-o", "--output", required=True, help="output directory")
    action("prune", cmd_prune, "keep the K fastest records per workload").add_argument(
        "--keep-top", type=int, required=True, metavar="K")
    action("export", cmd_export, "write the records to one portable file").add_argument(
        "-o", "--output", required=True, help="file to write (JSON)")
    import_parser = action("import", cmd_import, "add an exported file's records", directory=False)
    import_parser.add_argument("file", help="file written by `records export`")
    import_parser.add_argument("dir", help="records directory (created if missing)")
    action("validate", cmd_validate, "check every line; exit 1 if any is bad")
    action("stats", cmd_stats, "counts, targets, speed-ups").add_argument(
        "--json", action="store_true", help="print JSON")
    action("plot", cmd_plot, "PNG of the tuning curves").add_argument(
        "-o", "--output", required=True, help="PNG file to write")
