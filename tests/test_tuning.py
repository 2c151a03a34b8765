"""MetaSchedule tuning: tasks from our pipeline, resumable records, applying them in `build`."""

from __future__ import annotations

import functools
import io
import os
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from tvm.s_tir import meta_schedule as ms

import gimlet_tvm
from gimlet_tvm.schedules.kernel_selection.choices import SELECTION_FILE
from gimlet_tvm.schedules.tuning.records import RecordsDB
from gimlet_tvm.tuning import GIVE_UP_AFTER, default_schedule, extract_tasks, parse_duration

from .conftest import assert_matches, onnxruntime_outputs

TRIALS = 8
SMALL = {"trials_per_round": 4, "population_size": 16, "seed": 0}


def tiny_model() -> onnx.ModelProto:
    """softmax(relu(x + b)) and a row sum: an injective kernel and two reductions."""
    rng = np.random.default_rng(0)
    bias = helper.make_tensor("b", TensorProto.FLOAT, [256], rng.standard_normal(256).tolist())
    nodes = [
        helper.make_node("Add", ["x", "b"], ["s"]),
        helper.make_node("Relu", ["s"], ["r"]),
        helper.make_node("Softmax", ["r"], ["y"], axis=-1),
        helper.make_node("ReduceSum", ["r"], ["z"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 256]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [])],
        [bias],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@functools.lru_cache(maxsize=None)
def _tune_once(path: str) -> str:
    result = gimlet_tvm.tune(tiny_model(), "llvm", path, trials=TRIALS, **SMALL)
    assert result.trials_run >= TRIALS
    return path


@pytest.fixture
def tuned_records(tmp_path_factory) -> str:
    """Records from one short tuning run of `tiny_model`, made once per session (read-only)."""
    return _tune_once(str(tmp_path_factory.getbasetemp() / "tuned-records"))


@pytest.fixture
def records_copy(tuned_records, tmp_path) -> str:
    """A private copy of the tuned records, for tests that change them."""
    path = str(tmp_path / "records")
    shutil.copytree(tuned_records, path)
    return path


def test_tasks_come_from_our_pipeline_after_library_dispatch():
    _, tasks, skipped = extract_tasks(gimlet_tvm.models.SUITE["mlp"].build(),
                                      input_shapes={"x": [32, 1024]})
    # The three matmuls and their bias/relu epilogues are OpenBLAS calls: nothing to tune.
    assert not tasks and not skipped
    _, tasks, skipped = extract_tasks(gimlet_tvm.models.SUITE["transformer_encoder"].build(),
                                      input_shapes={"x": [1, 64, 256], "attention_mask": [1, 64]})
    # Matmuls and attention go to the library; the fused LayerNorm is ours to tune.
    names = [t.name for t in tasks]
    assert not skipped and "layer_norm" in names and all("matmul" not in n for n in names)
    _, tasks, skipped = extract_tasks(gimlet_tvm.models.SUITE["transformer_encoder"].build())
    assert not tasks and skipped  # symbolic batch: nothing measurable


def linear_model() -> onnx.ModelProto:
    """softmax(relu(x @ w + b)): one matmul group (library, hand-written and generated
    candidates) and a softmax kernel for MetaSchedule."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
               for name, shape in (("w", (64, 96)), ("b", (96,)))]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["s"]),
             helper.make_node("Relu", ["s"], ["r"]), helper.make_node("Softmax", ["r"], ["y"], axis=-1)]
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 96])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.slow  # ~100 s in CI: CI ran 60 minutes; selection alone is tested in test_kernel_selection.py
def test_tuning_also_selects_each_op_groups_kernel(tmp_path):
    """After MetaSchedule, `tune` chooses the matmul group's kernel by measurement and stores
    it beside the records; the tuned build applies both; a rerun with nothing new to tune
    keeps the stored choice."""
    path, log = str(tmp_path / "records"), io.StringIO()
    result = gimlet_tvm.tune(linear_model(), "llvm", path, trials=4, log=log, **SMALL)
    (choice,) = result.selection.choices.values()
    assert choice.signature.weight and choice.winner is not None
    assert sum(t.verified for t in choice.tried) >= 3  # generated, library, hand-written at least
    assert "[select] matmul float32 8x64 @ const 64x96 +96 relu: library:openblas" in log.getvalue()
    assert log.getvalue().index("[select]") < log.getvalue().index("[tune ")  # selection first
    assert os.path.isfile(os.path.join(path, SELECTION_FILE))
    tuned = gimlet_tvm.build(linear_model(), "llvm", records=path)
    assert tuned.targets[0]["selected_kernels"] == 1 and tuned.targets[0]["tuned_tasks"] >= 1
    x = np.random.default_rng(1).standard_normal((8, 64), dtype=np.float32)
    assert_matches(tuned(x), onnxruntime_outputs(linear_model(), {"x": x}))
    log = io.StringIO()
    again = gimlet_tvm.tune(linear_model(), "llvm", path, trials=4, log=log, **SMALL)
    assert again.trials_run == 0 and "[select]" not in log.getvalue()
    assert again.selection.choices[choice.signature.key].winner == choice.winner


@pytest.mark.slow  # ~90 s; CI keeps test_tuning_also_selects_each_op_groups_kernel
def test_tune_generated_tunes_each_op_groups_generated_kernel(tmp_path):
    """With `tune_generated` the matmul group's generated TIR is a task of its own, named after
    the group; a build that runs the group's generated kernel applies its record, one more
    than the build that runs the library call."""
    path = str(tmp_path / "records")
    result = gimlet_tvm.tune(linear_model(), "llvm", path, trials=12, tune_generated=True,
                             log=io.StringIO(), **SMALL)
    (group,) = [t for t in result.tasks if t.name.endswith("generated)")]
    assert "8x64 @ const 64x96 +96 relu" in group.name and group.trials > 0 and group.best
    builds = {source: gimlet_tvm.build(linear_model(), "llvm", records=path,
                                       selection=result.selection.restricted_to(source))
              for source in ("generated", "library")}
    applied = {source: model.targets[0]["tuned_tasks"] for source, model in builds.items()}
    assert applied["generated"] == applied["library"] + 1 >= 2
    x = np.random.default_rng(1).standard_normal((8, 64), dtype=np.float32)
    assert_matches(builds["generated"](x), onnxruntime_outputs(linear_model(), {"x": x}))


def test_records_are_metaschedule_json_database(tuned_records):
    ours = RecordsDB(tuned_records)
    assert not ours.problems and len(ours.records) >= TRIALS
    upstream = ms.database.JSONDatabase(work_dir=tuned_records)
    assert len(upstream) == len(ours.records)
    assert any(r.seconds is not None for r in ours.records)


def test_each_task_is_measured_with_its_default_schedule_first(tuned_records):
    """Before the search, each task's kernel as the untuned build schedules it (the default
    rules, or none) is measured and recorded: the best record, which a tuned build applies, is
    never slower than the default schedule."""
    target, tasks, _ = extract_tasks(tiny_model(), "llvm")
    db = ms.database.JSONDatabase(work_dir=tuned_records)
    for task in tasks:
        workload = db.commit_workload(task.mod)
        records = db.get_top_k(workload, 1000)
        default = default_schedule(task, target).trace.as_python()
        measured = [r for r in records if r.trace.as_python() == default]
        assert measured and measured[0].run_secs, task.name
        assert records[0].as_measure_candidate() is not None
        seconds = lambda r: sum(float(t) for t in r.run_secs) / len(r.run_secs)
        assert seconds(records[0]) <= seconds(measured[0])


def test_tuned_build_applies_records_and_matches_onnxruntime(tuned_records):
    model = tiny_model()
    x = np.random.default_rng(1).standard_normal((16, 256), dtype=np.float32)
    tuned = gimlet_tvm.build(model, "llvm", records=tuned_records)
    assert 1 <= tuned.targets[0]["tuned_tasks"] <= len(RecordsDB(tuned_records).best())
    assert_matches(tuned(x), onnxruntime_outputs(model, {"x": x}))
    assert gimlet_tvm.build(model, "llvm").targets[0]["tuned_tasks"] == 0


def test_rerun_resumes_from_the_records(records_copy):
    before = len(RecordsDB(records_copy).records)
    again = gimlet_tvm.tune(tiny_model(), "llvm", records_copy, trials=before, **SMALL)
    assert again.trials_run == 0 and len(RecordsDB(records_copy).records) == before
    more = gimlet_tvm.tune(tiny_model(), "llvm", records_copy, trials=before + 2, **SMALL)
    # Only what is left of the total; the last round may overshoot it (MetaSchedule checks
    # the budget before a round), by less than a round.
    assert 2 <= more.trials_run < 2 + SMALL["trials_per_round"]
    db = RecordsDB(records_copy)
    assert len(db.records) == before + more.trials_run and not db.problems
    assert sum(t.trials for t in more.tasks) == len(db.records)


def test_failing_candidates_are_recorded_and_a_task_that_always_fails_is_given_up(tmp_path):
    # A run timeout no candidate can meet: every candidate fails; each task gets GIVE_UP_AFTER
    # rounds (or fewer, where its search runs out), then no more: tuning ends far within budget.
    path, log = str(tmp_path / "records"), io.StringIO()
    result = gimlet_tvm.tune(tiny_model(), "llvm", path, trials=1000, runner_timeout=1e-3, log=log,
                             **SMALL)
    db = RecordsDB(path)
    rounds = GIVE_UP_AFTER * len(result.tasks)
    assert result.trials_run <= rounds * SMALL["trials_per_round"] and len(db.records) == result.trials_run
    assert all(r.seconds is None for r in db.records) and not db.problems
    assert result.estimated_latency is None
    given_up = [t for t in result.tasks if t.failed_rounds == GIVE_UP_AFTER]
    assert given_up and all(t in given_up or t.exhausted for t in result.tasks)  # a 1-schedule task runs out
    assert log.getvalue().count(f"every candidate of {GIVE_UP_AFTER} rounds failed; no more trials") \
        == len(given_up)


def test_time_budget_is_the_whole_runs_selection_included(tmp_path):
    """A time budget spent before selection starts leaves every op group to its default
    kernel and runs no MetaSchedule trial; the records still build (a later run chooses the
    groups the records lack: `test_tuning_also_selects_each_op_groups_kernel`)."""
    path, log = str(tmp_path / "records"), io.StringIO()
    spent = gimlet_tvm.tune(linear_model(), "llvm", path, time_budget=1e-3, log=log, **SMALL)
    assert spent.trials_run == 0 and not spent.selection.choices
    assert "time budget reached: 1 of 1 op groups keep their default kernels" in log.getvalue()
    assert "the time budget is spent: no MetaSchedule trials" in log.getvalue()
    x = np.random.default_rng(1).standard_normal((8, 64), dtype=np.float32)
    assert_matches(gimlet_tvm.build(linear_model(), "llvm", records=path)(x),
                   onnxruntime_outputs(linear_model(), {"x": x}))


def test_budgets_are_checked():
    assert parse_duration("10m") == 600 and parse_duration("90s") == 90 and parse_duration(2) == 2
    with pytest.raises(gimlet_tvm.GimletError, match="time budget"):
        parse_duration("soon")
    with pytest.raises(gimlet_tvm.GimletError, match="budget"):
        gimlet_tvm.tune(tiny_model(), "llvm", "unused")


def test_tune_and_compile_cli(cli, records_copy, tmp_path):
    onnx.save(tiny_model(), str(tmp_path / "tiny.onnx"))
    total = len(RecordsDB(records_copy).records)
    code, out, err = cli("tune", "tiny.onnx", "--records", records_copy, "--trials", str(total))
    assert code == 0, err
    assert f"{total} trials in {records_copy}" in err and "ran 0 trials" in out
    code, out, err = cli("compile", "tiny.onnx", "-o", "tiny.so", "--records", records_copy)
    assert code == 0, err
    assert "tuned kernels: " in out and "tuned kernels: 0" not in out
    code, _, err = cli("tune", "tiny.onnx", "--records", "r", "--time-budget", "soon")
    assert code == 2 and "gimlet-tvm: error: time budget" in err
    assert os.path.exists(tmp_path / "tiny.so")
