"""ONNX backend node conformance: each `onnx.backend.test.case.node` test via `gimlet_tvm.build`.

Run from the repository root:

    .venv/bin/python -m tests.conformance.runner --report tests/conformance/coverage_llvm.md

The test cases are generated in memory from `onnx.backend.test.case.node` (recent onnx wheels
ship no test data files). Each test runs in a persistent worker process that imports TVM once
and handles tests one by one; a worker that crashes or passes the per-test timeout is killed and
replaced, and only that test fails.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import re
import sys
import time
import traceback
import warnings
from typing import Any, Iterable, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
EXPECTED_PASS_FILE = os.path.join(HERE, "expected_pass_{target}.txt")

PASS = "pass"
IMPORT = "import"
COMPILE = "compile"
RUN = "run"
WRONG = "wrong result"
# Our output matches the ONNX reference implementation run in float64, the stored expected output
# does not: the test data carries float32 rounding beyond the test's own tolerance.
IMPRECISE_REFERENCE = "imprecise reference"
TIMEOUT_OR_CRASH = "timeout/crash"
NON_TENSOR = "non-tensor"
# Report column order; NON_TENSOR cases are not run (the API takes and returns tensors only).
CATEGORIES = (PASS, IMPORT, COMPILE, RUN, WRONG, IMPRECISE_REFERENCE, TIMEOUT_OR_CRASH,
              NON_TENSOR)

_EXPANDED_SUFFIX = re.compile(r"_expanded(_ver\d+)?$")


@dataclasses.dataclass(frozen=True)
class Case:
    """One node test: the model, its inputs by name, the expected outputs in graph order."""

    name: str
    op: str
    tensor_only: bool
    model: bytes
    inputs: dict[str, np.ndarray]
    expected: list[np.ndarray]
    rtol: float
    atol: float


@dataclasses.dataclass(frozen=True)
class Result:
    """How one test ended: a category from `CATEGORIES`, a one-line reason and its time."""

    name: str
    op: str
    category: str
    detail: str = ""
    seconds: float = 0.0
    onnxruntime: bool | None = None  # whether onnxruntime passes the same test (None: not run)


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    return np.asarray(value)


def _node_op(node: onnx.NodeProto) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def _op_of(test: Any, op_by_name: dict[str, str]) -> str:
    """The operator a test is about; an `_expanded` test belongs to its base test's op."""
    base = _EXPANDED_SUFFIX.sub("", test.name)
    if base != test.name and base in op_by_name:
        return op_by_name[base]
    return _node_op(test.model.graph.node[0])


def _is_tensor_only(model: onnx.ModelProto) -> bool:
    values = list(model.graph.input) + list(model.graph.output)
    return all(info.type.HasField("tensor_type") for info in values)


def collect_cases() -> list[Case]:
    """All ONNX backend node test cases, sorted by name."""
    import onnx.backend.test.case.node as node_cases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        tests = sorted(node_cases.collect_testcases(), key=lambda t: t.name)
    op_by_name = {t.name: _node_op(t.model.graph.node[0]) for t in tests
                  if len(t.model.graph.node) == 1}
    cases = []
    for test in tests:
        (inputs, outputs), = test.data_sets
        tensor_only = _is_tensor_only(test.model)
        input_names = [info.name for info in test.model.graph.input]
        cases.append(
            Case(
                name=test.name,
                op=_op_of(test, op_by_name),
                tensor_only=tensor_only,
                model=test.model.SerializeToString(),
                inputs=dict(zip(input_names, map(_as_array, inputs))) if tensor_only else {},
                expected=list(map(_as_array, outputs)) if tensor_only else [],
                rtol=test.rtol,
                atol=test.atol,
            )
        )
    return cases


def select(cases: Sequence[Case], pattern: str | None, subset: int | None) -> list[Case]:
    """Cases whose name matches `pattern`, then `subset` of them spread evenly over the names."""
    chosen = [c for c in cases if pattern is None or re.search(pattern, c.name)]
    if subset is not None and subset < len(chosen):
        step = len(chosen) / subset
        chosen = [chosen[int(i * step)] for i in range(subset)]
    return chosen


# --- worker side ------------------------------------------------------------------------------


def compare_outputs(expected: Sequence[np.ndarray], actual: Sequence[np.ndarray], rtol: float,
                    atol: float) -> str | None:
    """None if `actual` matches as `onnx.backend.test.runner` checks it, else why not."""
    if len(actual) != len(expected):
        return f"{len(actual)} outputs, expected {len(expected)}"
    for index, (want, got) in enumerate(zip(expected, actual)):
        if got.shape != want.shape:
            return f"output {index}: shape {got.shape}, expected {want.shape}"
        if want.dtype == object:
            if not np.array_equal(got, want):
                return f"output {index}: strings differ"
            continue
        if got.dtype != want.dtype:
            return f"output {index}: dtype {got.dtype}, expected {want.dtype}"
        output_rtol = rtol
        if got.dtype.name == "bfloat16":
            output_rtol = max(rtol, 2**-6)  # two bfloat16 ULPs, as the ONNX runner allows
        if got.dtype.type.__module__.startswith("ml_dtypes"):
            got, want = got.astype(np.float32), want.astype(np.float32)
        try:
            np.testing.assert_allclose(got, want, rtol=output_rtol, atol=atol)
        except AssertionError as err:
            lines = [line.strip() for line in str(err).splitlines()]
            facts = [line for line in lines if "ismatch" in line or line.startswith("Max abs")]
            return f"output {index}: {'; '.join(facts) or lines[1]}"
    return None


def _failure_stage(err: BaseException) -> str:
    """IMPORT if `err` was raised while loading or importing the model, else COMPILE."""
    from gimlet_tvm.errors import ModelLoadError, UnsupportedOpError

    if isinstance(err, (ModelLoadError, UnsupportedOpError)):
        return IMPORT
    frames = traceback.extract_tb(err.__traceback__)
    in_frontend = any(
        os.path.basename(f.filename) == "frontend.py" and f.name in ("load_model", "import_model")
        for f in frames
    )
    return IMPORT if in_frontend else COMPILE


def _one_line(err: BaseException) -> str:
    """`Type: first line`; an error raised while handling another one names that one first."""
    text = str(err).strip()
    line = f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
    if err.__context__ is not None and err.__cause__ is None and not err.__suppress_context__:
        line = f"{_one_line(err.__context__)} [then, while handling it, {line}]"
    return line[:400]


def run_case(case: Case, target: str) -> tuple[str, str]:
    """Build, run and check one tensor-only case in this process: (category, detail)."""
    import gimlet_tvm

    try:
        compiled = gimlet_tvm.build(case.model, target)
    except Exception as err:  # every failure is a result here, classified by where it happened
        return _failure_stage(err), _one_line(err)
    try:
        by_name = compiled.run(case.inputs)
        output_names = [info.name for info in onnx.load_from_string(case.model).graph.output]
        missing = [name for name in output_names if name not in by_name]
        if missing:
            return WRONG, f"outputs {missing} missing; got {sorted(by_name)}"
        actual = [np.asarray(by_name[name]) for name in output_names]
    except Exception as err:
        return RUN, _one_line(err)
    return check_outputs(case, actual)


def check_outputs(case: Case, actual: Sequence[np.ndarray]) -> tuple[str, str]:
    """(PASS, ""), or why `actual` is not `case`'s expected output: WRONG, or
    IMPRECISE_REFERENCE when it is the stored data that misses the float64 reference."""
    mismatch = compare_outputs(case.expected, actual, case.rtol, case.atol)
    if mismatch is None:
        return PASS, ""
    exact = float64_reference(case)
    if (exact is not None and compare_outputs(exact, actual, case.rtol, case.atol) is None
            and compare_outputs(exact, case.expected, case.rtol, case.atol) is not None):
        return IMPRECISE_REFERENCE, f"stored {mismatch}; ours matches onnx's float64 reference"
    return WRONG, mismatch


def float64_reference(case: Case) -> list[np.ndarray] | None:
    """`case`'s outputs by `onnx.reference` with float32 inputs and outputs made float64, cast
    back to float32; None when the reference implementation cannot run it that way."""
    from onnx.reference import ReferenceEvaluator

    model = onnx.load_from_string(case.model)
    for info in list(model.graph.input) + list(model.graph.output):
        if info.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            info.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    inputs = {name: value.astype(np.float64) if value.dtype == np.float32 else value
              for name, value in case.inputs.items()}
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            outputs = ReferenceEvaluator(model).run(None, inputs)
    except Exception:  # the reference has no float64 path for this op: no second opinion
        return None
    return [np.asarray(out).astype(want.dtype) for out, want in zip(outputs, case.expected)]


def run_onnxruntime(case: Case) -> bool:
    """Whether onnxruntime (CPU, one thread) runs `case` and matches its expected outputs."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 4
    try:
        session = onnxruntime.InferenceSession(case.model, options,
                                               providers=["CPUExecutionProvider"])
        actual = session.run(None, case.inputs)
    except Exception:  # onnxruntime rejecting or failing the test is a failed test
        return False
    return compare_outputs(case.expected, [np.asarray(a) for a in actual], case.rtol,
                           case.atol) is None


def worker_main(conn: multiprocessing.connection.Connection, target: str, quiet: bool) -> None:
    """Worker process: import TVM once, then answer `(category, detail)` per received case."""
    if quiet:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    warnings.simplefilter("ignore")
    # Workers run side by side, one per core: each must not start a thread per core.
    os.environ.update(TVM_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    import gimlet_tvm  # noqa: F401  (the slow import, done before reporting ready)

    conn.send("ready")
    while True:
        try:
            case = conn.recv()
        except EOFError:
            return
        if case is None:
            return
        conn.send((*run_case(case, target), run_onnxruntime(case)))


# --- parent side ------------------------------------------------------------------------------

class _Worker:
    """One worker process with its pipe, the case it is running and when that case started."""

    def __init__(self, context: Any, target: str, quiet: bool):
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=worker_main, args=(child_conn, target, quiet),
                                       daemon=True)
        self.process.start()
        child_conn.close()
        self.ready = False
        self.case: Case | None = None
        self.started = 0.0

    def assign(self, case: Case) -> None:
        self.case, self.started = case, time.monotonic()
        self.conn.send(case)

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.kill()


def run_cases(cases: Sequence[Case], target: str, jobs: int, timeout: float, quiet: bool = True,
              progress: bool = False) -> list[Result]:
    """Run `cases` over `jobs` crash-isolated workers; results come back sorted by name."""
    results = [Result(c.name, c.op, NON_TENSOR, "sequence/optional-typed") for c in cases
               if not c.tensor_only]
    pending: collections.deque[Case] = collections.deque(c for c in cases if c.tensor_only)
    total = len(pending)
    context = multiprocessing.get_context("spawn")
    workers = [_Worker(context, target, quiet) for _ in range(min(max(1, jobs), total))]
    done = 0

    def finish(worker: _Worker, category: str, detail: str, ort: bool | None = None) -> None:
        nonlocal done
        case = worker.case
        assert case is not None
        seconds = time.monotonic() - worker.started
        results.append(Result(case.name, case.op, category, detail, seconds, ort))
        worker.case = None
        done += 1
        if progress:
            line = f"[{done}/{total}] {case.name}: {category} ({seconds:.1f} s) {detail}"
            print(line[:200], flush=True)

    def replace(index: int) -> None:
        workers[index] = _Worker(context, target, quiet)

    try:
        while pending or any(w.case is not None for w in workers):
            for worker in workers:
                if worker.ready and worker.case is None and pending:
                    worker.assign(pending.popleft())
            busy = [w for w in workers if w.case is not None]
            wait_for = min((w.started + timeout for w in busy), default=time.monotonic() + 1.0)
            ready = multiprocessing.connection.wait(
                [w.conn for w in workers], timeout=max(0.0, wait_for - time.monotonic()))
            for index, worker in enumerate(workers):
                if worker.conn in ready:
                    try:
                        message = worker.conn.recv()
                    except (EOFError, OSError):
                        worker.process.join(timeout=5)
                        code = worker.process.exitcode
                        if not worker.ready:
                            raise RuntimeError(f"a worker failed to start (exit code {code}); "
                                               "run with --verbose to see why") from None
                        if worker.case is not None:
                            finish(worker, TIMEOUT_OR_CRASH, f"worker died (exit code {code})")
                        worker.kill()
                        replace(index)
                        continue
                    if message == "ready":
                        worker.ready = True
                    else:
                        finish(worker, *message)
                elif worker.case is not None and time.monotonic() - worker.started > timeout:
                    finish(worker, TIMEOUT_OR_CRASH, f"timed out after {timeout:g} s")
                    worker.kill()
                    replace(index)
    finally:
        for worker in workers:
            worker.stop()
    return sorted(results, key=lambda r: r.name)


# --- reporting --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Summary:
    """Pass counts overall and over tensor-only cases, with the count per category."""

    total: int
    tensor_total: int
    passed: int
    by_category: dict[str, int]
    onnxruntime_passed: int

    @classmethod
    def of(cls, results: Sequence[Result]) -> "Summary":
        counts = collections.Counter(r.category for r in results)
        return cls(len(results), len(results) - counts[NON_TENSOR], counts[PASS],
                   {c: counts[c] for c in CATEGORIES}, sum(bool(r.onnxruntime) for r in results))

    def describe(self) -> str:
        def rate(n: int, d: int) -> str:
            return f"{n}/{d} ({100.0 * n / d:.1f}%)" if d else f"{n}/0"

        kinds = ", ".join(f"{c}: {n}" for c, n in self.by_category.items() if c != PASS)
        return (f"passed {rate(self.passed, self.total)} overall, "
                f"{rate(self.passed, self.tensor_total)} of tensor-only cases; {kinds}; "
                f"onnxruntime on the same tensor-only cases: "
                f"{rate(self.onnxruntime_passed, self.tensor_total)}")


def markdown_report(results: Sequence[Result], target: str, wall_seconds: float, jobs: int) -> str:
    """Summary, per-op table (op, tests, pass, each failure kind) and every failure's reason."""
    import tvm  # only for the version line; imported late so workers are not delayed

    summary = Summary.of(results)
    per_op: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for result in results:
        per_op[result.op][result.category] += 1
    lines = [
        f"# ONNX backend node conformance: `{target}`",
        "",
        f"Generated by `python -m tests.conformance.runner --target {target} --report ...` "
        f"(onnx {onnx.__version__}, TVM {tvm.__version__}); {len(results)} tests in "
        f"{wall_seconds:.0f} s wall with {jobs} workers.",
        "",
        f"**{summary.describe()}**",
        "",
        "Non-tensor cases take or return sequences/optionals, which the API does not support; "
        "they are not run and count as neither pass nor failure kind.",
        "",
        "| op | tests | " + " | ".join(CATEGORIES) + " | onnxruntime pass |",
        "|---|---:|" + "---:|" * (len(CATEGORIES) + 1),
    ]
    ort_per_op = collections.Counter(r.op for r in results if r.onnxruntime)
    for op in sorted(per_op, key=str.lower):
        counts = per_op[op]
        cells = " | ".join(str(counts[c]) if counts[c] else "" for c in CATEGORIES)
        lines.append(f"| {op} | {sum(counts.values())} | {cells} | {ort_per_op[op] or ''} |")
    totals = " | ".join(str(summary.by_category[c]) for c in CATEGORIES)
    lines += [f"| **all** | {summary.total} | {totals} | {summary.onnxruntime_passed} |", "",
              "## Failures", ""]
    lines += ["| test | kind | onnxruntime | reason |", "|---|---|---|---|"]
    for result in results:
        if result.category not in (PASS, NON_TENSOR):
            reason = result.detail.replace("|", "\\|").replace("\n", " ")
            ort = {True: "pass", False: "fail", None: ""}[result.onnxruntime]
            lines.append(f"| {result.name} | {result.category} | {ort} | {reason} |")
    return "\n".join(lines) + "\n"


def ops_table(results: Sequence[Result], target: str) -> str:
    """Per-op coverage: tests, our passes and onnxruntime's on the same tests, tensor-only."""
    tests: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    ort: collections.Counter[str] = collections.Counter()
    for result in results:
        if result.category == NON_TENSOR:
            continue
        tests[result.op] += 1
        ours[result.op] += result.category == PASS
        ort[result.op] += bool(result.onnxruntime)
    summary = Summary.of(results)
    lines = [
        f"# ONNX op coverage: `{target}` against onnxruntime",
        "",
        "Each row counts the ONNX backend node tests of one op (tensor-only cases; `_expanded` "
        "tests count for their op) that gimlet-tvm and onnxruntime (CPU provider) pass, "
        "checked the same way. Generated by `python -m tests.conformance.runner --ops-table ...`.",
        "",
        f"**{summary.describe()}**",
        "",
        "| op | tests | gimlet-tvm | onnxruntime |",
        "|---|---:|---:|---:|",
    ]
    for op in sorted(tests, key=str.lower):
        lines.append(f"| {op} | {tests[op]} | {ours[op]} | {ort[op]} |")
    lines.append(f"| **all** | {sum(tests.values())} | {sum(ours.values())} | "
                 f"{sum(ort.values())} |")
    return "\n".join(lines) + "\n"


def read_expected(path: str) -> set[str]:
    """Test names listed in an expected-pass file (one per line; blank lines ignored)."""
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def write_expected(path: str, results: Sequence[Result]) -> set[str]:
    """Rewrite the expected-pass file for the tests that ran; entries for others are kept."""
    ran = {r.name for r in results}
    passing = (read_expected(path) - ran) | {r.name for r in results if r.category == PASS}
    with open(path, "w") as f:
        f.writelines(f"{name}\n" for name in sorted(passing))
    return passing


def regressions(results: Sequence[Result], expected: Iterable[str]) -> list[Result]:
    """Results of tests in `expected` that ran and did not pass."""
    wanted = set(expected)
    return [r for r in results if r.name in wanted and r.category != PASS]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.conformance.runner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="llvm", help="gimlet_tvm target name (default llvm)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per test")
    parser.add_argument("--filter", metavar="REGEX", help="run tests whose name matches REGEX")
    parser.add_argument("--subset", type=int, metavar="K", help="run K tests spread evenly by name")
    parser.add_argument("--report", metavar="PATH.md", help="write the per-op Markdown report")
    parser.add_argument("--ops-table", metavar="PATH.md",
                        help="write the per-op table: our passes next to onnxruntime's")
    parser.add_argument("--expected", metavar="PATH", help="expected-pass list (default "
                        "tests/conformance/expected_pass_TARGET.txt)")
    parser.add_argument("--update-expected", action="store_true",
                        help="rewrite the expected-pass list with the tests that pass now")
    parser.add_argument("--only-expected", action="store_true",
                        help="run only the tests in the expected-pass list")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a test in the expected-pass list no longer passes "
                        "or any test gives a wrong result")
    parser.add_argument("--progress", action="store_true", help="print each test's result")
    parser.add_argument("--verbose", action="store_true", help="let workers print TVM's output")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = parse_args(argv)
    expected_path = args.expected or EXPECTED_PASS_FILE.format(target=args.target)
    from gimlet_tvm.errors import UnknownTargetError
    from gimlet_tvm.targets import lookup

    try:
        lookup(args.target)
    except UnknownTargetError as err:
        print(err, file=sys.stderr)
        return 2
    start = time.monotonic()
    cases = collect_cases()
    if args.only_expected:
        listed = read_expected(expected_path)
        cases = [case for case in cases if case.name in listed]
    cases = select(cases, args.filter, args.subset)
    if not cases:
        print("no test matches", file=sys.stderr)
        return 2
    results = run_cases(cases, args.target, args.jobs, args.timeout, quiet=not args.verbose,
                        progress=args.progress)
    wall = time.monotonic() - start
    summary = Summary.of(results)
    print(f"{args.target}: {summary.describe()}")
    print(f"wall time {wall:.0f} s for {len(results)} tests with {args.jobs} workers")
    if args.report:
        with open(args.report, "w") as f:
            f.write(markdown_report(results, args.target, wall, args.jobs))
        print(f"report written to {args.report}")
    if args.ops_table:
        with open(args.ops_table, "w") as f:
            f.write(ops_table(results, args.target))
        print(f"per-op table written to {args.ops_table}")
    if args.update_expected:
        passing = write_expected(expected_path, results)
        print(f"{len(passing)} expected passes written to {expected_path}")
    if args.check:
        expected = read_expected(expected_path)
        if not expected:
            print(f"--check: no expected-pass list at {expected_path}", file=sys.stderr)
            return 1
        lost = regressions(results, expected)
        if lost:
            print(f"{len(lost)} expected-pass test(s) no longer pass:")
            for result in lost:
                print(f"  {result.name}: {result.category}: {result.detail}")
        wrong = [r for r in results if r.category == WRONG]
        if wrong:
            print(f"{len(wrong)} test(s) give wrong results:")
            for result in wrong:
                print(f"  {result.name}: {result.detail}")
        if lost or wrong:
            return 1
        checked = expected & {r.name for r in results}
        print(f"--check: all {len(checked)} expected passes still pass")
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a script: make `tests.conformance` importable
        sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    sys.exit(main())
