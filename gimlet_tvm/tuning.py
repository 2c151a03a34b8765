"""`tune`: MetaSchedule autotuning of a model's kernels, resumable from its records directory.

Tasks are the fused TIR kernels our own pipeline builds (`compiler.fusion_passes`: after
library dispatch, so matmul/conv2d sent to OpenBLAS are not tasks). Kernels whose shapes are
still symbolic cannot be measured and are skipped (fix them with `input_shapes`).

Trial allocation (`WeightedScheduler`): each task is first given one round; after that every
round goes to the task with the largest share of the estimated model latency per trial spent,
`weight * best_latency / trials` (weight: calls per model run). Over a run, trials thus go to
tasks in proportion to their share of the kernels' end-to-end time. A task whose candidates
all failed counts with the slowest measured latency, until `GIVE_UP_AFTER` rounds of it failed
with nothing ever measured: then it gets no more trials (MetaSchedule cannot schedule that
kernel, e.g. legalized attention in this TVM, "T_reshape_global is used before its
definition") and keeps its default schedule.

Default schedules first: a new task's kernel as the untuned build schedules it (the target's
default rules; none: as it is) is measured before the search and recorded as its first
trial, so the best record applied to a kernel is never one slower than its default: a
10-minute budget over DenseNet-121's 120 concat and pooling tasks left each a few trials,
and those schedules made the tuned model 1.09x the untuned one's time.

Measurement: on targets whose spec `tunes_cache_cold` (the CPU), each candidate is timed one
run at a time with its operands but the first flushed from the caches, as kernel selection
times them and as a model's weights arrive (another layer's have evicted them); timed warm, a
memory-bound kernel whose weight fits in the cache would be tuned for reading it from there.

Kernel selection: each op group with several implementations (a matmul or conv2d and its
epilogue, attention: library, hand-written, generated) is verified and timed
(`selection.select_kernels`) and the winners stored beside the records, so `build(records=DIR)`
applies both. A model whose heavy ops are all library calls thus still gets tuned: by measuring
which kernel runs each op. Selection runs first, before MetaSchedule: the op groups are most of
a model's time, and MetaSchedule's tasks (the kernels outside the groups) do not change their
candidates. It chooses only the groups the records lack a choice for, so a rerun carries on
where a time budget stopped it.

Time budget: `time_budget` is the wall time of the whole run, selection included. Selection
stops starting op groups at the deadline (the groups left keep the target's default kernels
until a rerun chooses them) and MetaSchedule gets what is left.

With `tune_generated`, each op group's generated candidate (the op's TIR with its epilogue,
one kernel, as `sources.generated` builds it) is a task too, weighted by the group's count, so that
selection measures it tuned rather than default-scheduled: then MetaSchedule runs first, on
`GENERATED_SHARE` of the time budget, and new trials make selection choose every group again. Off by default: those trials only
pay off where generated code can beat the library and hand-written kernels, and their tasks
count in the progress line's estimate although the model runs only the group's winner.

Resuming: `trials` is the total for the model's tasks in the records directory. A rerun counts
the trials already recorded, warms the XGBoost cost model with them, seeds the evolutionary
search with the best of them (MetaSchedule draws part of its initial population from the
database) and runs only what is left (the last round may overshoot by less than a round).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from typing import IO, Sequence

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .compiler import Targets, kernel_tasks, resolve_target
from .errors import GimletError
from .frontend import InputShapes, ModelLike, import_model, load_model
from .logs import quiet_tvm_logs
from .runtime.remote import RemoteDevice
from .schedules.kernel_selection.apply import rewrite_ops
from .schedules.kernel_selection.candidates import OpSignature
from .schedules.kernel_selection.choices import KernelSelection
from .schedules.kernel_selection.sources import generated
from .schedules.rules import default_rules
from .schedules.tuning.records import FAILED_SECONDS, RecordsDB, record_json
from .selection.select import op_signatures, select_kernels
from .targets import DEFAULT_TARGET, spec_for

Duration = float | str
GENERATED_SHARE = 0.5  # of a time budget, MetaSchedule's before selection with `tune_generated`
GIVE_UP_AFTER = 2  # rounds of a task in which every candidate failed, none ever measured


@dataclass
class TuningTask:
    """One kernel to tune and where its tuning stands."""

    name: str
    weight: int
    mod: tvm.IRModule
    workload: list  # MetaSchedule's workload JSON: [structural hash, module]
    trials: int = 0
    best: float | None = None  # seconds
    exhausted: bool = False  # the search found no new candidate in its last round
    failed_rounds: int = 0  # rounds in which every candidate failed, while none ever ran

    @property
    def open(self) -> bool:
        """Whether the task may get another round."""
        return not self.exhausted and (self.best is not None or self.failed_rounds < GIVE_UP_AFTER)

    @property
    def shash(self) -> str:
        return str(self.workload[0])


@dataclass
class TuneResult:
    """What a `tune` run did; `tasks` hold the totals including earlier runs."""

    records: str
    tasks: list[TuningTask]
    skipped: list[str]
    trials_run: int
    seconds: float
    selection: KernelSelection | None = None  # the op groups' kernels as chosen (None: not run)

    @property
    def estimated_latency(self) -> float | None:
        """Sum over tasks of weight x best latency (seconds); None until all are measured."""
        return _estimate(self.tasks)


def _estimate(tasks: Sequence[TuningTask]) -> float | None:
    if any(t.best is None for t in tasks):
        return None
    return sum(t.weight * t.best for t in tasks)


def parse_duration(value: Duration) -> float:
    """Seconds from a number or a string like `90`, `90s`, `10m`, `1.5h`."""
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([smh]?)\s*", value)
        if not match:
            raise GimletError(f"time budget must look like 90s, 10m or 1h, got '{value}'")
        seconds = float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[match[2]]
    if seconds <= 0:
        raise GimletError(f"time budget must be positive, got {value}")
    return seconds


def extract_tasks(
    model: ModelLike | tvm.IRModule, target: Targets = DEFAULT_TARGET, *, input_shapes: InputShapes | None = None
) -> tuple[tvm.target.Target, list[TuningTask], list[str]]:
    """The model's kernels as our pipeline builds them: (target, tunable tasks, skipped names)."""
    device = resolve_target(target)
    tvm_target = device[1]
    mod = model if isinstance(model, tvm.IRModule) else import_model(load_model(model), input_shapes)[0]
    tasks, skipped = [], []
    for task in kernel_tasks(mod, device):
        kernel = task.dispatched[0]
        try:
            ms.arg_info.ArgInfo.from_prim_func(kernel["main"])
        except TypeError:  # symbolic shapes: MetaSchedule cannot allocate arguments
            skipped.append(task.task_name)
            continue
        workload = ms.database.Workload(kernel).as_json()
        tasks.append(TuningTask(task.task_name, int(task.weight), kernel, workload))
    return tvm_target, tasks, skipped


def generated_group_tasks(groups: dict[OpSignature, int], target: Targets) -> list[TuningTask]:
    """The kernels of each op group's generated candidate as tasks (weight: the group's count)."""
    tvm_target = resolve_target(target)[1]
    tasks = []
    for sig, count in groups.items():
        (candidate,) = generated(sig, tvm_target, None)
        mod, _ = rewrite_ops(sig.module(), lambda _: candidate, tvm_target)
        for task in extract_tasks(mod, target)[1]:
            task.name, task.weight = f"{task.name} ({sig.key}, generated)", count * task.weight
            tasks.append(task)
    return tasks


def _progress_line(task: TuningTask, tasks: Sequence[TuningTask], done: int, budget: str,
                   elapsed: float) -> str:
    best = f"{task.best * 1e3:.4f} ms" if task.best is not None else "none yet"
    model = _estimate(tasks)
    measured = sum(t.best is not None for t in tasks)
    estimate = (
        f"{model * 1e3:.3f} ms" if model is not None else f"? ({measured}/{len(tasks)} measured)"
    )
    return (
        f"[tune {elapsed:6.0f}s] {task.name}: {task.trials} trials, best {best} | "
        f"kernels per model run {estimate} | run {done}/{budget} trials"
    )


@derived_object
class RecordAndReport(ms.measure_callback.PyMeasureCallback):
    """After each measured round: append the round to the records and print progress."""

    def __init__(self, records: RecordsDB, tasks: list[TuningTask], target: tvm.target.Target,
                 budget: str, log: IO[str]) -> None:
        super().__init__()
        self.records, self.tasks, self.target = records, tasks, target
        self.budget, self.log = budget, log
        self.done = 0
        self.start = time.monotonic()

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
              runner_results) -> None:
        self.record(task_id, measure_candidates, builder_results, runner_results)

    def record(self, task_id, measure_candidates, builder_results, runner_results) -> None:
        """Append one task's measured candidates to the records and print progress."""
        task = self.tasks[task_id]
        if not measure_candidates:
            task.exhausted = True
            return
        workload = ms.database.Workload(task.mod)
        lines, errors = [], []
        for candidate, built, ran in zip(measure_candidates, builder_results, runner_results):
            ok = built.error_msg is None and ran.error_msg is None and ran.run_secs
            if not ok:
                errors.append(str(built.error_msg or ran.error_msg or "no run time").strip())
            run_secs = [float(s) for s in ran.run_secs] if ok else [FAILED_SECONDS]
            record = ms.database.TuningRecord(
                candidate.sch.trace, workload, run_secs, self.target, candidate.args_info
            )
            lines.append((task.workload, record_json(record)))
            if ok:
                seconds = sum(run_secs) / len(run_secs)
                task.best = seconds if task.best is None else min(task.best, seconds)
        self.records.add(lines, dedupe=False)
        task.trials += len(lines)
        self.done += len(lines)
        elapsed = time.monotonic() - self.start
        if errors:
            first = errors[0].splitlines()
            print(f"[tune] {task.name}: {len(errors)} of {len(lines)} candidates failed; first: "
                  f"{first[-1][:200] if first else '?'}", file=self.log)
        if task.best is None and len(errors) == len(lines):
            task.failed_rounds += 1
            if not task.open:
                print(f"[tune] {task.name}: every candidate of {task.failed_rounds} rounds failed; "
                      "no more trials for it (it keeps its default schedule)", file=self.log)
        print(_progress_line(task, self.tasks, self.done, self.budget, elapsed), file=self.log,
              flush=True)


@derived_object
class WeightedScheduler(ms.task_scheduler.PyTaskScheduler):
    """Gives each round to the task with the largest latency share per trial (module doc)."""

    def __init__(self, tasks: list[TuningTask], deadline: float) -> None:
        super().__init__()
        self.tasks, self.deadline = tasks, deadline
        self.running: int | None = None

    def next_task_id(self) -> int:
        records = self._outer().tasks_
        if self.running is not None and not records[self.running].is_terminated:
            self.join_running_task(self.running)
        self.running = None
        live = [
            i for i, record in enumerate(records)
            if not record.is_terminated and self.tasks[i].open
        ]
        if not live or time.monotonic() >= self.deadline:
            return -1
        fresh = [i for i in live if self.tasks[i].trials == 0]
        if fresh:
            self.running = fresh[0]
        else:
            slowest = max((t.best for t in self.tasks if t.best is not None), default=1.0)
            share = lambda i: self.tasks[i].weight * (self.tasks[i].best or slowest)
            self.running = max(live, key=lambda i: share(i) / self.tasks[i].trials)
        return self.running


def build_kernel(mod: tvm.IRModule, target: tvm.target.Target, _params: dict | None) -> tvm.runtime.Module:
    """MetaSchedule's default build, without its import of every target's tensor intrinsics
    (about 30 s in each fresh builder process here; LLVM CPU candidates do not use them)."""
    from tvm.driver import build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    return build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)


def _warm_cost_model(cost_model: ms.cost_model.CostModel, contexts: list[ms.TuneContext],
                     tasks: list[TuningTask], records: RecordsDB) -> None:
    """Train the cost model on the records earlier runs measured for these tasks."""
    by_hash = {w.shash: w.index for w in records.workloads if w is not None}
    for context, task in zip(contexts, tasks):
        if task.shash not in by_hash:
            continue
        done = [r for r in records.records_of(by_hash[task.shash]) if r.seconds is not None]
        if done:
            cost_model.update(
                context,
                [records.tuning_record(r).as_measure_candidate() for r in done],
                [ms.runner.RunnerResult([r.seconds], None) for r in done],
            )


# Building one candidate takes well under a second, but the builder's first job (a sanity check
# in a fresh worker process) imports TVM: on a loaded machine that alone takes seconds.
BUILD_TIMEOUT_S = 60.0


# Cache-cold timing: one run per repeat, each after the flush (more runs per repeat would find
# the operands cached again).
COLD_REPEATS = 5


def _runner(remote: RemoteDevice | None, timeout: float, cache_cold: bool) -> ms.runner.Runner:
    """Where candidates are measured: locally, or on devices from an RPC tracker; with
    `cache_cold`, each run after flushing its operands but the first from the CPU caches."""
    if cache_cold:
        evaluator = ms.runner.EvaluatorConfig(number=1, repeat=COLD_REPEATS, min_repeat_ms=0,
                                              enable_cpu_cache_flush=True)
    else:
        evaluator = ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=40)
    if remote is None:
        return ms.runner.LocalRunner(timeout_sec=timeout, evaluator_config=evaluator)
    if remote.tracker is None:
        raise GimletError("tuning on remote devices needs a tracker (--tracker and --key)")
    remote.check_key()
    host, port = remote.address()  # with a key file: the local relay that authenticates
    config = ms.runner.RPCConfig(
        tracker_host=host, tracker_port=port, tracker_key=remote.key,
        session_timeout_sec=int(max(timeout, 1)),
    )
    return ms.runner.RPCRunner(rpc_config=config, evaluator_config=evaluator, max_workers=1)


@quiet_tvm_logs()
def tune(
    model: ModelLike,
    target: Targets = DEFAULT_TARGET,
    records: str = "tuning_records",
    *,
    trials: int | None = None,
    time_budget: Duration | None = None,
    input_shapes: InputShapes | None = None,
    trials_per_round: int = 16,
    population_size: int = 512,
    runner_timeout: float = 10.0,
    seed: int | None = None,
    remote: RemoteDevice | None = None,
    select: bool = True,
    tune_generated: bool = False,
    log: IO[str] = sys.stderr,
) -> TuneResult:
    """Tune `model`'s kernels for `target` with MetaSchedule (XGBoost cost model) into `records`.

    `trials`: total measured candidates over the model's tasks in `records` (earlier runs
    count); `time_budget`: wall time for this run, kernel selection included (seconds, or "10m";
    an op group whose selection started before it ends is finished). At least one is needed.
    `trials_per_round` candidates are measured per round, chosen by an evolutionary search over
    `population_size` schedules ranked by the cost model. A candidate that fails to build, crashes
    or runs past `runner_timeout` seconds is recorded as failed and tuning goes on. Progress goes to `log`, one line a round.
    `remote`: measure on devices handed out by an RPC tracker (MetaSchedule's RPC runner); a
    server lost during tuning fails its candidates, and the others carry on.
    `select`: then choose each op group's kernel by measurement (module docstring), on the
    same device. `tune_generated`: tune the groups' generated candidates first.
    """
    if trials is None and time_budget is None:
        raise GimletError("give a trial budget (trials) or a time budget (time_budget), or both")
    if trials is not None and trials <= 0:
        raise GimletError(f"trials must be positive, got {trials}")
    start = time.monotonic()
    deadline = start + parse_duration(time_budget) if time_budget is not None else float("inf")
    mod, _ = import_model(load_model(model), input_shapes)
    tvm_target, tasks, skipped = extract_tasks(mod, target)
    if skipped:
        print(f"[tune] skipping {len(skipped)} kernels with symbolic shapes "
              f"(fix them with input shapes): {', '.join(skipped)}", file=log)
    groups = op_signatures(mod, tvm_target) if select else {}
    if tune_generated:
        known = {t.shash for t in tasks}
        tasks += [t for t in generated_group_tasks(groups, target) if t.shash not in known]
    if not tasks and not groups:
        raise GimletError("the model has no tunable kernels (all symbolic, or all library calls "
                          "without other candidates)")
    db = RecordsDB(records, create=True)
    tune_tasks = functools.partial(
        _tune_tasks, tasks, tvm_target, db, trials=trials, trials_per_round=trials_per_round,
        population_size=population_size, runner_timeout=runner_timeout, seed=seed, remote=remote, log=log)
    # Generated group candidates are measured with the records tuned for them, so with
    # `tune_generated` MetaSchedule runs first (on its share of the budget), and its new
    # records make every group's choice stale.
    trials_run = tune_tasks(deadline=start + GENERATED_SHARE * (deadline - start)) if tune_generated else 0
    selection = KernelSelection.load(db.path, tvm_target)
    if trials_run:  # the generated candidates' new records make every choice stale
        selection = None
    if groups and (selection is None or any(sig.key not in selection.choices for sig in groups)):
        print(f"[select] {len(groups)} op groups: verifying and timing their candidates", file=log)
        selection = select_kernels(mod, tvm_target, records=db.path, remote=remote, known=selection,
                                   deadline=deadline, progress=_selection_progress(log))
        selection.save(db.path)
        left = [sig for sig in groups if sig.key not in selection.choices]
        if left:
            print(f"[select] time budget reached: {len(left)} of {len(groups)} op groups keep their "
                  "default kernels (a rerun chooses them)", file=log)
    if not tune_generated:
        trials_run = tune_tasks(deadline=deadline)
    return TuneResult(records, tasks, skipped, trials_run, time.monotonic() - start,
                      selection if groups else None)


def _selection_progress(log: IO[str]):
    return lambda line: print(f"[select] {line}", file=log, flush=True)


def _tune_tasks(tasks: list[TuningTask], tvm_target: tvm.target.Target, db: RecordsDB, *,
                trials: int | None, deadline: float, trials_per_round: int, population_size: int,
                runner_timeout: float, seed: int | None, remote: RemoteDevice | None,
                log: IO[str]) -> int:
    """MetaSchedule over `tasks` until `trials` (total, earlier runs included) or `deadline`;
    the number of trials run."""
    if not tasks:
        return 0
    db.add([], tasks={t.shash: {"name": t.name, "weight": t.weight} for t in tasks})
    for task in tasks:
        task.trials, task.best = db.progress(task.shash, tvm_target)
    already = sum(t.trials for t in tasks)
    remaining = (trials - already) if trials is not None else 10**9
    print(f"[tune] {len(tasks)} tasks, {already} trials in {db.path}; "
          f"running {remaining if trials is not None else 'until the time budget'}", file=log)
    if remaining <= 0:
        return 0
    if time.monotonic() >= deadline:
        print("[tune] the time budget is spent: no MetaSchedule trials this run", file=log)
        return 0

    cores = int(tvm_target.attrs.get("num-cores", 1))
    contexts = [
        ms.TuneContext(
            mod=t.mod, target=tvm_target, space_generator="post-order-apply",
            search_strategy=ms.search_strategy.EvolutionarySearch(population_size=population_size),
            task_name=t.name, num_threads=cores,
            rand_state=-1 if seed is None else seed + i,
        ).clone()
        for i, t in enumerate(tasks)
    ]
    report = RecordAndReport(db, tasks, tvm_target, str(trials) if trials else "time", log)
    runner = _runner(remote, runner_timeout, spec_for(tvm_target).tunes_cache_cold)
    builder = ms.builder.LocalBuilder(max_workers=cores, timeout_sec=max(BUILD_TIMEOUT_S, 3 * runner_timeout),
                                      f_build=build_kernel)
    _measure_defaults(tasks, tvm_target, builder, runner, report, log)
    cost_model = ms.cost_model.XGBModel(num_tuning_cores=cores)
    _warm_cost_model(cost_model, contexts, tasks, db)
    # TaskScheduler.tune itself (PyTaskScheduler.tune passes one argument too few in 0.27).
    ms.task_scheduler.task_scheduler._ffi_api.TaskSchedulerTune(
        WeightedScheduler(tasks, deadline),
        contexts, [float(t.weight) for t in tasks], remaining, remaining, trials_per_round,
        builder, runner,
        [*ms.measure_callback.MeasureCallback.create("default"), report],
        db.database(tvm_target, best_only=False), cost_model,
    )
    return report.done


def default_schedule(task: TuningTask, target: tvm.target.Target) -> tvm.s_tir.Schedule:
    """The task's kernel as an untuned build schedules it: the first of the target's default
    rules that applies (as `dlight.ApplyDefaultSchedule` picks), else as it is."""
    func = task.mod["main"]
    for rule in default_rules(spec_for(target), target):
        applied = rule.apply(func, target, False)
        if applied:
            return applied[0] if isinstance(applied, list) else applied
    return tvm.s_tir.Schedule(task.mod)


def _measure_defaults(tasks: list[TuningTask], target: tvm.target.Target, builder: ms.builder.Builder,
                      runner: ms.runner.Runner, report: RecordAndReport, log: IO[str]) -> None:
    """Measure and record the default schedule of each task without trials yet (module doc)."""
    new = [i for i, t in enumerate(tasks) if t.trials == 0]
    if not new:
        return
    print(f"[tune] the default schedules of {len(new)} new tasks first", file=log)
    candidates = [ms.MeasureCandidate(default_schedule(tasks[i], target),
                                      ms.arg_info.ArgInfo.from_prim_func(tasks[i].mod["main"])) for i in new]
    built = builder.build([ms.builder.BuilderInput(c.sch.mod, target) for c in candidates])
    device = tvm.runtime.device(target.get_target_device_type()).__device_type_name__()
    for i, candidate, result in zip(new, candidates, built):
        if result.error_msg is None:
            (future,) = runner.run([ms.runner.RunnerInput(result.artifact_path, device, candidate.args_info)])
            ran = future.result()
            shutil.rmtree(os.path.dirname(result.artifact_path), ignore_errors=True)
        else:
            ran = ms.runner.RunnerResult(None, result.error_msg)
        report.record(i, [candidate], [result], [ran])
