"""The measurements behind the CPU's default GEMM choice (issue #26, `targets.cpu.cpu_default_kernel`):
a linear layer (fp32 matmul by a constant weight, plus bias) through the CPU library
(`library:openblas`, what an untuned build ran before) against the hand-written packed GEMMs
(`handwritten:cpu_gemm_packed_4x2v`, `..._tallx2v`: B packed at build time), timed
interleaved in one process, on the GEMM shapes of the suite's and the torch benchmark's models
and a few tall and skinny ones.

    TVM_NUM_THREADS=2 OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 \
        .venv/bin/python benchmarks/gemm_defaults.py [--shapes mlp bert] [--rounds 30]

Prints one row per shape: each candidate's median ms (p10-p90) and its time over the library's
(below 1: faster than the library).
"""

from __future__ import annotations

import argparse

import numpy as np
import tvm
from tvm import relax

from gimlet_tvm.compiler import device_pipeline, resolve_target
from gimlet_tvm.peers import time_interleaved
from gimlet_tvm.schedules.kernel_selection.apply import ApplyKernelSelection
from gimlet_tvm.schedules.kernel_selection.candidates import OpSignature
from gimlet_tvm.schedules.kernel_selection.sources import find

CANDIDATES = ("library:openblas", "handwritten:cpu_gemm_packed_4x2v", "handwritten:cpu_gemm_packed_tallx2v")

# name -> (M, K, N): rows, reduction, columns of the layer's GEMM.
SHAPES = {
    **{f"mlp b{b} {k}x{n}": (b, k, n) for b in (1, 8, 32) for k, n in ((1024, 4096), (4096, 4096), (4096, 1024))},
    **{f"bert/gpt2 s128 {k}x{n}": (128, k, n) for k, n in ((768, 768), (768, 2304), (768, 3072), (3072, 768))},
    **{f"encoder b8 s64 {k}x{n}": (512, k, n) for k, n in ((256, 256), (256, 1024), (1024, 256))},
    "encoder b1 s64 256x1024": (64, 256, 1024),
    "square 1024": (1024, 1024, 1024),
    "tall 8192x256x256": (8192, 256, 256),
    "skinny 16x4096x4096": (16, 4096, 4096),
    "skinny 4x4096x4096": (4, 4096, 4096),
    "small 32x256x256": (32, 256, 256),
    "small 32x128x512": (32, 128, 512),
    "tiny 8x64x96": (8, 64, 96),
    "head 32x1024x10": (32, 1024, 10),
    "square 2048": (2048, 2048, 2048),
    "tall 2048x768x768": (2048, 768, 768),
}


def signature(m: int, k: int, n: int) -> OpSignature:
    return OpSignature("matmul", ((m, k), (k, n)), "float32", (("add", (n,)),), weight=True)


def build(sig: OpSignature, weight: np.ndarray, candidate: str):
    """`sig` with `weight` as a constant, its group rewritten into `candidate`, as a VM callable."""
    spec, target = resolve_target("llvm")
    choose = ApplyKernelSelection(lambda s: find(candidate, s, target), target)
    with target:
        executable = tvm.compile(sig.module([weight]), target,
                                 relax_pipeline=device_pipeline([(spec, target)], selection=choose))
    return relax.VirtualMachine(executable, tvm.cpu())["main"]


def measure(name: str, m: int, k: int, n: int, rounds: int) -> str:
    rng = np.random.default_rng(0)
    sig = signature(m, k, n)
    weight = rng.standard_normal((k, n)).astype("float32")
    x, bias = rng.standard_normal((m, k)).astype("float32"), rng.standard_normal(n).astype("float32")
    args = [tvm.runtime.tensor(x), tvm.runtime.tensor(bias)]
    expected = x.astype(np.float64) @ weight + bias
    calls = {}
    for candidate in CANDIDATES:
        main = build(sig, weight, candidate)
        out = main(*args)[0].numpy()
        error = np.abs(out - expected).max() / np.abs(expected).max()
        assert error < 1e-4, f"{name}: {candidate} is off by {error:.2e}"
        calls[candidate] = lambda main=main: main(*args)
    times = time_interleaved(calls, repeat=rounds)
    library = times[CANDIDATES[0]].median_ms
    gflop = 2 * m * n * k / 1e9
    cells = [f"{t.median_ms:.3f} ({t.p10_ms:.3f}-{t.p90_ms:.3f}) {gflop / t.median_ms * 1e3:.0f} GF/s "
             f"x{t.median_ms / library:.2f}" for t in times.values()]
    return f"| {name} | {m}x{k}x{n} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", help="keep the shapes whose name contains one of these")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    print("| shape | MxKxN | " + " | ".join(CANDIDATES) + " |")
    print("|---|---|" + "---|" * len(CANDIDATES))
    for name, (m, k, n) in SHAPES.items():
        if not args.shapes or any(word in name for word in args.shapes):
            print(measure(name, m, k, n, args.rounds), flush=True)


if __name__ == "__main__":
    main()
