"""GFLOP/s of convolutions and GEMMs (issue #26): ours against OpenBLAS, oneDNN and
onnxruntime's MLAS, and the machine's measured FMA peak, layer by layer.

    .venv/bin/python benchmarks/conv_gemm.py [--threads 1] [--shapes resnet18 bert ...] [--quick]
        [--select subset|all|none] [--tune-seconds N] [--wait-idle S] [--json out.json]

Shapes: every distinct Conv2d of torchvision's ResNet-18, ResNet-50 and MobileNetV2 at batch 1
and 224x224 (taken from `torch_models`' definitions by a forward pass: 3x3, 1x1, 7x7, strided,
depthwise), BERT-base's GEMMs at sequence 128 (QKV, attention output, FFN up and down), and a
large square and two tall-skinny GEMMs. `--shapes` keeps those whose name contains any of the
words given.

Engines, all pinned to `--threads` threads:
- ours untuned: a one-op ONNX model (Conv without bias, or MatMul by a constant) through
  `gimlet_tvm.build(model, "llvm")`, the default path;
- ours selected: `select_kernels` over that model (every candidate verified and timed), then
  `build(records=..., selection=...)`; about 10 s a shape, so by default only the `SELECTED`
  subset (`--select all` for every shape);
- ours tuned: `gimlet_tvm.tune` with `--tune-seconds` of budget per shape (tuned generated
  code, then selection); not run by default (MetaSchedule needs minutes per shape);
- OpenBLAS: numpy's scipy-openblas sgemm (`x @ w`); convolutions as im2col in numpy plus
  sgemm (batched over groups), the im2col counted in the time;
- oneDNN: torch's CPU build (oneDNN 3.12): `torch.mkldnn_convolution` on NCHW tensors (each
  call reorders input, weights and output between NCHW and oneDNN's blocked layout, so this
  understates oneDNN; `torch.nn.functional.conv2d` sends 1x1 stride-1 convolutions to MKL's
  GEMM instead, not oneDNN) and `mkldnn_linear` for GEMMs (weights converted once); oneDNN's
  verbose log is read once per shape to check that a oneDNN primitive ran;
- onnxruntime (MLAS): the same one-op model in an onnxruntime session;
- peak: `fma_peak.c` (chains of independent AVX-512 or AVX2 FMAs, picked at run time),
  compiled here with `cc -O3`.

Every engine's output is checked against numpy in float64 (max error at most 1e-3 of the
largest |reference|) before it is timed; an engine that fails or disagrees is left out of that
shape, with the reason listed. Each engine is then timed in its own block (warm-up calls, then
as many calls as fit `--budget` seconds, 10 to 200), so its workers find the machine as a loop
of its own calls leaves it. Cells are GFLOP/s at the median time (GFLOP/s at p90 and p10 time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from threadpoolctl import ThreadpoolController

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine_info import cpu_name, cpu_seconds, other_load, versions, wait_idle  # noqa: E402  (benchmarks/ is not a package)

# torch and gimlet_tvm (and so TVM) are imported after main() pinned the thread counts; numpy's
# OpenBLAS is limited at run time (threadpoolctl).

ENGINES = ("untuned", "selected", "tuned", "openblas", "onednn", "ort")
LABEL = {"untuned": "ours untuned", "selected": "ours selected", "tuned": "ours tuned",
         "openblas": "OpenBLAS", "onednn": "oneDNN", "ort": "onnxruntime MLAS"}
OURS = ("untuned", "selected", "tuned")
NETWORKS = ("resnet18", "resnet50", "mobilenetv2")
# Shapes that get kernel selection unless --select says otherwise: one of each kind of layer.
SELECTED = ("resnet18 conv 3x224x224 k7/2 -> 64", "resnet18 conv 64x56x56 k3/1 -> 64",
            "resnet18 conv 128x28x28 k3/1 -> 128", "resnet18 conv 64x56x56 k1/2 -> 128",
            "resnet50 conv 64x56x56 k1/1 -> 256", "resnet50 conv 1024x14x14 k1/1 -> 256",
            "mobilenetv2 conv 144x56x56 k3/1 -> 144 dw", "mobilenetv2 conv 96x112x112 k3/2 -> 96 dw",
            "mobilenetv2 conv 24x56x56 k1/1 -> 144", "bert qkv", "bert ffn up",
            "gemm square 1024")
QUICK = ("mobilenetv2 conv 32x112x112 k3/1 -> 32 dw",)
TOLERANCE = 1e-3


@dataclass(frozen=True)
class Problem:
    """One layer: a batch-1 NCHW convolution (no bias) or a GEMM `x[M, K] @ w[K, N]`."""

    name: str
    networks: tuple[str, ...]
    conv: tuple[int, ...] | None = None  # C, H, W, out channels, kernel, stride, padding, groups
    gemm: tuple[int, int, int] | None = None  # M, K, N

    @property
    def flops(self) -> float:
        if self.gemm:
            m, k, n = self.gemm
            return 2.0 * m * k * n
        c, _, _, o, k, _, _, g = self.conv
        oh, ow = self.out_hw
        return 2.0 * o * oh * ow * (c // g) * k * k

    @property
    def out_hw(self) -> tuple[int, int]:
        _, h, w, _, k, s, p, _ = self.conv
        return (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1

    def operands(self) -> tuple[np.ndarray, np.ndarray]:
        """Seeded input and weights, fp32."""
        rng = np.random.default_rng(0)
        if self.gemm:
            m, k, n = self.gemm
            return (rng.standard_normal((m, k), dtype=np.float32),
                    (rng.standard_normal((k, n), dtype=np.float32) / np.sqrt(k)).astype(np.float32))
        c, h, w, o, k, _, _, g = self.conv
        x = rng.standard_normal((1, c, h, w), dtype=np.float32)
        weights = rng.standard_normal((o, c // g, k, k), dtype=np.float32) / np.sqrt(c // g * k * k)
        return x, weights.astype(np.float32)


def problems() -> list[Problem]:
    """Every shape measured by default, convolutions of the three networks first."""
    from torch_models import conv_layers

    found: dict[tuple, list[str]] = {}
    for network in NETWORKS:
        for layer in conv_layers(network):
            _, c, h, w = layer.input_shape
            key = (c, h, w, layer.out_channels, layer.kernel, layer.stride, layer.padding, layer.groups)
            found.setdefault(key, []).append(network)
    out = []
    for key, networks in found.items():
        c, h, w, o, k, s, _, g = key
        kind = " dw" if g == c and g > 1 else (f" g{g}" if g > 1 else "")
        out.append(Problem(f"{networks[0]} conv {c}x{h}x{w} k{k}/{s} -> {o}{kind}", tuple(networks), conv=key))
    bert = {"qkv": (128, 768, 768), "out": (128, 768, 768), "ffn up": (128, 768, 3072),
            "ffn down": (128, 3072, 768)}
    out += [Problem(f"bert {name}", ("bert",), gemm=mkn) for name, mkn in bert.items()]
    out += [Problem("gemm square 1024", (), gemm=(1024, 1024, 1024)),
            Problem("gemm tall 8192x256x256", (), gemm=(8192, 256, 256)),
            Problem("gemm skinny 16x4096x4096", (), gemm=(16, 4096, 4096))]
    return out


def one_op_model(problem: Problem, weights: np.ndarray) -> onnx.ModelProto:
    """The layer as an ONNX model: input `x`, weights a constant, output `y`."""
    if problem.gemm:
        m, _, n = problem.gemm
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
        x_shape, y_shape = [m, problem.gemm[1]], [m, n]
    else:
        c, h, w, o, k, s, p, g = problem.conv
        node = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[k, k], strides=[s, s],
                                pads=[p] * 4, group=g)
        x_shape, y_shape = [1, c, h, w], [1, o, *problem.out_hw]
    graph = helper.make_graph([node], "layer",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
                              [numpy_helper.from_array(weights, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def im2col_conv(problem: Problem, x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The convolution as numpy's im2col and a matmul batched over groups (OpenBLAS sgemm);
    in float64 when given float64 (the reference)."""
    c, _, _, o, k, s, p, g = problem.conv
    oh, ow = problem.out_hw
    padded = np.pad(x[0], ((0, 0), (p, p), (p, p)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (k, k), axis=(1, 2))[:, ::s, ::s]
    # [C, OH, OW, k, k] -> [G, C/G * k * k, OH * OW]
    cols = windows.reshape(g, c // g, oh, ow, k, k).transpose(0, 1, 4, 5, 2, 3).reshape(g, -1, oh * ow)
    out = np.matmul(weights.reshape(g, o // g, -1), cols)
    return out.reshape(1, o, oh, ow)


def reference(problem: Problem, x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The layer in float64 numpy."""
    x64, w64 = x.astype(np.float64), weights.astype(np.float64)
    return x64 @ w64 if problem.gemm else im2col_conv(problem, x64, w64)


Call = Callable[[], object]


@dataclass
class Cell:
    """One engine on one shape: GFLOP/s at median/p90/p10 time, or why there is none."""

    gflops: float | None = None
    gflops_p90: float | None = None  # at the p90 time (the slow end)
    gflops_p10: float | None = None
    runs: int = 0
    note: str | None = None  # what ran
    error: str | None = None  # why it failed or disagreed
    skipped: str | None = None  # why it was left out on purpose


@dataclass
class Row:
    problem: Problem
    cells: dict[str, Cell] = field(default_factory=dict)


class Engines:
    """Builders of each engine's call for a problem: `make(engine, problem, x, w)` returns a
    function producing the output as numpy, and a note (what ran)."""

    def __init__(self, threads: int, select: str, tune_seconds: float, records_root: Path) -> None:
        import torch

        torch.set_num_threads(threads)
        self.torch, self.threads = torch, threads
        self.select, self.tune_seconds, self.records_root = select, tune_seconds, records_root

    def make(self, engine: str, problem: Problem, x: np.ndarray, weights: np.ndarray
             ) -> tuple[Call, str | None]:
        return getattr(self, f"_{engine}")(problem, x, weights)

    def _untuned(self, problem: Problem, x, weights) -> tuple[Call, str | None]:
        import gimlet_tvm

        compiled = gimlet_tvm.build(one_op_model(problem, weights), "llvm")
        return lambda: compiled(x)[0], None

    def _selected(self, problem: Problem, x, weights) -> tuple[Call, str | None]:
        import gimlet_tvm
        from gimlet_tvm.compiler import resolve_target
        from gimlet_tvm.frontend import import_model
        from gimlet_tvm.selection.select import select_kernels

        if self.select == "none" or (self.select == "subset" and problem.name not in SELECTED):
            raise NotRun(f"not selected (--select {self.select})")
        model = one_op_model(problem, weights)
        records = tempfile.mkdtemp(prefix="select-", dir=self.records_root)
        _, target = resolve_target("llvm")
        mod, _ = import_model(model, {"x": list(x.shape)})
        selection = select_kernels(mod, target, records=records, timeout=120, min_repeat_ms=10)
        compiled = gimlet_tvm.build(model, "llvm", records=records, selection=selection)
        winners = ", ".join(str(choice.winner) for choice in selection.choices.values())
        return lambda: compiled(x)[0], f"selected {winners}"

    def _tuned(self, problem: Problem, x, weights) -> tuple[Call, str | None]:
        import gimlet_tvm

        if not self.tune_seconds:
            raise NotRun("not run: tuning takes minutes per shape (--tune-seconds N to run it)")
        model = one_op_model(problem, weights)
        records = tempfile.mkdtemp(prefix="tune-", dir=self.records_root)
        with open(os.devnull, "w") as quiet:
            result = gimlet_tvm.tune(model, "llvm", records, time_budget=self.tune_seconds,
                                     input_shapes={"x": list(x.shape)}, tune_generated=True, log=quiet)
        compiled = gimlet_tvm.build(model, "llvm", records=records, selection=result.selection)
        return lambda: compiled(x)[0], f"{result.trials_run} trials in {result.seconds:.0f} s"

    def _openblas(self, problem: Problem, x, weights) -> tuple[Call, str | None]:
        if problem.gemm:
            return lambda: x @ weights, "sgemm"
        return lambda: im2col_conv(problem, x, weights), "im2col + sgemm (numpy)"

    def _onednn(self, problem: Problem, x, weights) -> tuple[Call, str | None]:
        torch = self.torch
        x_t, w_t = torch.from_numpy(x), torch.from_numpy(weights)
        if problem.gemm:
            w_packed = w_t.t().contiguous().to_mkldnn()  # [N, K], converted once

            def call():
                return torch._C._nn.mkldnn_linear(x_t.to_mkldnn(), w_packed, None).to_dense().numpy()
        else:
            _, _, _, _, _, s, p, g = problem.conv

            def call():
                return torch.mkldnn_convolution(x_t, w_t, None, [p, p], [s, s], [1, 1], g).numpy()
        return call, "oneDNN " + onednn_primitive(call, "matmul" if problem.gemm else "convolution")

    def _ort(self, problem: Problem, x, weights) -> tuple[Call, str | None]:
        from gimlet_tvm.peers import onnxruntime_session

        session = onnxruntime_session(one_op_model(problem, weights), self.threads)
        return lambda: session.run(None, {"x": x})[0], None


class NotRun(Exception):
    """An engine left out of a shape on purpose (the message says why)."""


def onednn_primitive(call: Call, kind: str) -> str:
    """The implementation oneDNN's verbose log names for its `kind` primitive during `call()`
    (the log goes to the process's stdout, so file descriptor 1 is redirected to read it);
    raises if no such primitive ran: torch then did not use oneDNN."""
    import torch

    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+") as log:
        os.dup2(log.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                call()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        lines = log.read().splitlines()
    # onednn_verbose,v1,primitive,exec,cpu,<primitive>,<implementation>,...
    found = [line.split(",") for line in lines if line.startswith("onednn_verbose") and ",exec," in line]
    impls = sorted({f[6] for f in found if len(f) > 6 and f[5] in (kind, "inner_product")})
    if not impls:
        raise RuntimeError(f"torch ran no oneDNN {kind} primitive")
    return "/".join(impls)


def measure(engines: Engines, problem: Problem, names: list[str], budget: float,
            log: Callable[[str], None]) -> Row:
    """Check each engine's output against numpy, then time it in a block of its own."""
    from gimlet_tvm.peers import max_abs_diff, time_interleaved

    x, weights = problem.operands()
    expected = reference(problem, x, weights)
    scale = float(np.abs(expected).max()) or 1.0
    row = Row(problem)
    for engine in names:
        cell = row.cells[engine] = Cell()
        try:
            call, cell.note = engines.make(engine, problem, x, weights)
            error = max_abs_diff([np.asarray(call())], [expected]) / scale
            if not error <= TOLERANCE:
                raise RuntimeError(f"differs from numpy (max error {error:.1e} of max |ref|)")
            start = time.perf_counter()
            call()
            once = time.perf_counter() - start
            runs = int(np.clip(budget / max(once, 1e-6), 10, 200))
            latency = time_interleaved({engine: call}, repeat=runs, warmup=min(3, runs),
                                      settle=0, settle_s=0)[engine]
        except NotRun as reason:
            cell.skipped = str(reason)
            continue
        except Exception as exc:  # noqa: BLE001 - any failure is a result to report
            traceback.print_exc()
            cell.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            log(f"  {LABEL[engine]}: {cell.error}")
            continue
        cell.gflops = problem.flops / latency.median_ms / 1e6
        cell.gflops_p90 = problem.flops / latency.p90_ms / 1e6
        cell.gflops_p10 = problem.flops / latency.p10_ms / 1e6
        cell.runs = latency.runs
        log(f"  {LABEL[engine]}: {cell.gflops:.1f} GFLOP/s ({latency.median_ms:.3f} ms, "
            f"{latency.runs} runs){' - ' + cell.note if cell.note else ''}")
    return row


def numpy_blas_controller() -> ThreadpoolController:
    """threadpoolctl's handle on numpy's own OpenBLAS (the one in numpy.libs), to limit its
    threads at run time; other BLAS libraries in the process (TVM's, torch's) are left alone."""
    controller = ThreadpoolController()
    bundled = os.path.dirname(np.__file__) + ".libs"
    return controller.select(filepath=[lib.filepath for lib in controller.lib_controllers
                                       if lib.filepath and lib.filepath.startswith(bundled)])


def fma_peak(threads: int, seconds: float = 1.0, runs: int = 3) -> tuple[str, float]:
    """(ISA, GFLOP/s) of `fma_peak.c`, compiled into a scratch folder: the best of `runs`
    runs of `seconds` each."""
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "fma_peak"
        subprocess.run(["cc", "-O3", "-pthread", "-o", str(binary), str(HERE / "fma_peak.c")],
                       check=True, capture_output=True, text=True)
        results = [subprocess.run([str(binary), str(threads), str(seconds)], check=True,
                               capture_output=True, text=True).stdout.split() for _ in range(runs)]
    return results[0][0], max(float(r[1]) for r in results)


def _cell(cell: Cell | None) -> str:
    if cell is None or cell.gflops is None:
        return "—"
    return f"{cell.gflops:.1f} ({cell.gflops_p90:.1f}–{cell.gflops_p10:.1f})"


def _best(row: Row, engines: tuple[str, ...]) -> float | None:
    values = [row.cells[e].gflops for e in engines if e in row.cells and row.cells[e].gflops]
    return max(values) if values else None


def report(rows: list[Row], names: list[str], threads: int, peak: tuple[str, float],
           load: tuple[float | None, float | None], blas: list[dict]) -> str:
    """The Markdown table: a header naming machine, versions and peak, a row per shape, then
    the notes (what each engine ran, why a cell is empty)."""
    isa, gflops = peak
    peers = tuple(e for e in names if e not in OURS)
    header = ["layer", "networks", "GFLOP", *(LABEL[e] for e in names), "best ours / best peer",
              "best ours % peak"]
    pkgs = versions(["gimlet-tvm", "apache-tvm", "onnxruntime", "torch", "numpy"])
    before, during = (f"{x:.2f}" if x is not None else "unknown" for x in load)
    lines = [
        f"Date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}. Machine: {cpu_name()}, "
        f"{os.cpu_count()} logical cores, {platform.system()} {platform.machine()}. "
        f"Threads: {threads} per engine. Cores kept busy by other processes: {before} before the "
        f"run, {during} on average during it.",
        "Versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in pkgs.items())
        + "; numpy's BLAS: " + (", ".join(f"{i['internal_api']} {i['version']} "
                                           f"({i.get('architecture')} kernels)" for i in blas) or "unknown") + ".",
        f"Measured FMA peak ({isa}, {threads} thread{'s' if threads > 1 else ''}): "
        f"{gflops:.1f} GFLOP/s.",
        "Cells: GFLOP/s at the median time (at p90 – p10 time), batch 1, fp32.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    notes = []
    for row in rows:
        ours, peer = _best(row, OURS), _best(row, peers)
        cells = [row.problem.name, ", ".join(row.problem.networks) or "—",
                 f"{row.problem.flops / 1e9:.3f}", *(_cell(row.cells.get(e)) for e in names),
                 f"{ours / peer:.2f}" if ours and peer else "—",
                 f"{100 * ours / gflops:.0f}%" if ours else "—"]
        lines.append("| " + " | ".join(cells) + " |")
        for engine, cell in row.cells.items():
            if cell.error:
                notes.append(f"- {row.problem.name}, {LABEL[engine]}: {cell.error}")
            elif engine in ("selected", "tuned") and cell.note:
                notes.append(f"- {row.problem.name}, {LABEL[engine]}: {cell.note}")
    skipped = sorted({c.skipped for r in rows for c in r.cells.values() if c.skipped})
    notes += [f"- empty cells: {reason}" for reason in skipped]
    kinds = sorted({c.note for r in rows for e, c in r.cells.items() if e == "onednn" and c.note})
    if kinds:
        notes.append("- oneDNN implementations seen in its verbose log: " + ", ".join(kinds))
    return "\n".join([*lines, "", *notes]) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, pin thread counts, measure every chosen shape, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", nargs="+", metavar="WORD",
                        help="keep the shapes whose name contains one of these (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke test: {', '.join(QUICK)} only, short budgets, selection on")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--select", choices=("subset", "all", "none"), default="subset",
                        help="which shapes get kernel selection (subset: one of each kind of layer)")
    parser.add_argument("--tune-seconds", type=float, default=0.0,
                        help="tuning budget per shape for 'ours tuned' (default 0: not run)")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timed calls per engine")
    parser.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                        help="first wait up to this long for other processes to go quiet")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be at least 1")

    # Thread pools read these when they start, so set them before any engine is imported.
    for var in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    numpy_blas = numpy_blas_controller()
    chosen = problems()
    if args.quick:
        chosen = [p for p in chosen if p.name in QUICK]
        args.budget, args.select, peak_seconds, peak_runs = 0.1, "all", 0.2, 1
    else:
        peak_seconds, peak_runs = 1.0, 3
    if args.shapes:
        chosen = [p for p in chosen if any(word in p.name for word in args.shapes)]
        if not chosen:
            parser.error(f"no shape name contains any of {args.shapes}; names: "
                         + "; ".join(p.name for p in problems()))

    def log(msg: str) -> None:
        print(f"[conv_gemm] {msg}", file=sys.stderr, flush=True)

    load_before = wait_idle(args.wait_idle) if args.wait_idle else None
    start = cpu_seconds()
    peak = fma_peak(args.threads, peak_seconds, peak_runs)
    log(f"FMA peak: {peak[0]} {peak[1]:.1f} GFLOP/s at {args.threads} threads")
    with numpy_blas.limit(limits=args.threads), tempfile.TemporaryDirectory(prefix="conv-gemm-") as scratch:
        engines = Engines(args.threads, args.select, args.tune_seconds, Path(scratch))
        rows = []
        for index, problem in enumerate(chosen):
            log(f"{index + 1}/{len(chosen)} {problem.name} ({problem.flops / 1e9:.3f} GFLOP)")
            rows.append(measure(engines, problem, args.engines, args.budget, log))
    load = (load_before, other_load(start, cpu_seconds()))
    table = report(rows, args.engines, args.threads, peak, load, numpy_blas.info())
    print(table)
    if args.json:
        payload = {"threads": args.threads, "peak": {"isa": peak[0], "gflops": peak[1]},
                   "other_load": {"before": load[0], "during": load[1]},
                   "rows": [{"problem": asdict(r.problem), "flops": r.problem.flops,
                             "cells": {e: asdict(c) for e, c in r.cells.items()}} for r in rows]}
        from gimlet_tvm.files import atomic_path

        with atomic_path(args.json) as tmp:
            Path(tmp).write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
