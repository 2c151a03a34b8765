"""GPU check: the model suite on a GPU target, checked against onnxruntime and timed.

    .venv/bin/python benchmarks/gpu_check.py [--target cuda] [--models ...] [--repeat 50]

For each model: build for the target (arch detected from the GPU), run, compare the outputs
with onnxruntime on the CPU (rtol = atol = 1e-3: GPU math differs in the last bits), then time
ours against onnxruntime, interleaved. onnxruntime uses its CUDA execution provider where the
installed build has one, else the CPU. Prints a Markdown table; exits 1 if any model fails.
`--target llvm` runs the same checks on the CPU (how the script itself is tested).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import gimlet_tvm
from gimlet_tvm.models import SUITE
from gimlet_tvm.peers import max_abs_diff, onnxruntime_session, time_interleaved

TOLERANCE = 1e-3
BATCH = {"mlp": 32, "resnet_cnn": 8, "mobilenet_cnn": 8, "transformer_encoder": 8}


def peer_session(model, threads: int):
    """onnxruntime on CUDA where available (the GPU peer), else on the CPU."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        session = ort.InferenceSession(
            model.SerializeToString(), providers=["CUDAExecutionProvider"]
        )
        return session, "onnxruntime CUDA EP"
    return onnxruntime_session(model, threads), f"onnxruntime CPU ({threads} threads)"


def check_model(name: str, target: str, repeat: int, threads: int) -> list[str]:
    info = SUITE[name]
    proto = info.build()
    start = time.perf_counter()
    model = gimlet_tvm.build(proto, target)
    compile_s = time.perf_counter() - start
    inputs = info.example_inputs(batch=BATCH.get(name, 1))
    reference = onnxruntime_session(proto, threads).run(None, inputs)
    ours = model(*inputs.values())
    ok = all(np.allclose(o, r, rtol=TOLERANCE, atol=TOLERANCE) for o, r in zip(ours, reference))
    session, peer = peer_session(proto, threads)
    times = time_interleaved(
        {"ours": lambda: model(*inputs.values()), "peer": lambda: session.run(None, inputs)},
        repeat=repeat,
    )
    us, them = times["ours"], times["peer"]
    return [
        name, str(BATCH.get(name, 1)), "yes" if ok else "NO",
        f"{max_abs_diff(ours, reference):.2g}", f"{compile_s:.1f}",
        f"{us.median_ms:.3f} ({us.p10_ms:.3f}-{us.p90_ms:.3f})",
        f"{them.median_ms:.3f} ({them.p10_ms:.3f}-{them.p90_ms:.3f})", peer,
        f"{us.median_ms / them.median_ms:.2f}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="cuda")
    parser.add_argument("--models", nargs="*", default=list(SUITE))
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    header = ["model", "batch", "matches ORT", "max abs diff", "compile s", "ours ms (p10-p90)",
              "peer ms (p10-p90)", "peer", "ours/peer"]
    print(f"| {' | '.join(header)} |\n|{'---|' * len(header)}")
    failed = False
    for name in args.models:
        try:
            row = check_model(name, args.target, args.repeat, args.threads)
        except gimlet_tvm.GimletError as err:
            row = [name, "-", "NO", "-", "-", "-", "-", "-", str(err)]
        failed |= row[2] != "yes"
        print(f"| {' | '.join(row)} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
