"""`gimlet-tvm tune MODEL -t TARGET --records DIR`: tune the model's kernels with MetaSchedule."""

from __future__ import annotations

from ..tuning import tune
from .common import add_remote_args, add_target_args, format_table, parse_input_shapes, remote_device
from .select import format_selection


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "tune",
        help="autotune a model's kernels (MetaSchedule, XGBoost cost model); resumable",
        description="Tune the model's fused kernels into a records directory (MetaSchedule's "
        "JSON database). Rerunning continues from the records: --trials is the total.",
    )
    parser.add_argument("model", help="ONNX model file")
    add_target_args(parser)
    parser.add_argument("--records", required=True, metavar="DIR", help="records directory")
    parser.add_argument("--trials", type=int, help="total trials over the model's tasks")
    parser.add_argument("--time-budget", metavar="DURATION", help="wall time for this run, kernel selection included (90s, 10m, 1h)")
    parser.add_argument("--trials-per-round", type=int, default=16, help="candidates per round")
    parser.add_argument("--population", type=int, default=512, help="evolutionary search population")
    parser.add_argument("--runner-timeout", type=float, default=10.0,
                        help="seconds before a candidate's run counts as failed")
    parser.add_argument("--seed", type=int, default=None, help="search random seed")
    parser.add_argument("--no-select", dest="select", action="store_false",
                        help="skip choosing each op group's kernel by measurement after tuning")
    parser.add_argument("--tune-generated", action="store_true",
                        help="also tune each op group's generated TIR, so selection weighs it tuned")
    add_remote_args(parser)
    parser.set_defaults(handler=run)


def run(args) -> int:
    result = tune(
        args.model, args.target, args.records,
        trials=args.trials, time_budget=args.time_budget,
        input_shapes=parse_input_shapes(args.input_shape),
        trials_per_round=args.trials_per_round, population_size=args.population,
        runner_timeout=args.runner_timeout, seed=args.seed, remote=remote_device(args),
        select=args.select, tune_generated=args.tune_generated,
    )
    rows = [
        [t.name, str(t.weight), str(t.trials), f"{t.best * 1e3:.4f}" if t.best else "-"]
        for t in result.tasks
    ]
    if rows:
        print(format_table(["task", "weight", "trials", "best ms"], rows))
    if result.selection is not None:
        print(format_selection(result.selection))
    estimate = result.estimated_latency
    print(
        f"ran {result.trials_run} trials in {result.seconds:.0f} s -> {args.records}; "
        f"tuned kernels per model run: {f'{estimate * 1e3:.3f} ms' if estimate else 'not all measured'}"
    )
    return 0
