"""`gimlet-tvm bench MODEL_OR_ARTIFACT [--compare onnxruntime]`: latency table, ours vs peer."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import onnx

from ..errors import GimletError
from ..frontend import load_model
from ..peers import max_abs_diff, onnxruntime_session, time_interleaved
from ..runtime import CompiledModel, random_inputs
from .common import (
    add_remote_args,
    add_target_args,
    format_table,
    is_artifact,
    model_or_artifact,
    remote_device,
)

PEERS = ("onnxruntime",)


def add_parser(sub) -> None:
    parser = sub.add_parser("bench", help="measure latency, optionally against a peer engine")
    parser.add_argument("model", help="ONNX model, or an artifact (no --compare then)")
    parser.add_argument("--compare", choices=PEERS, help="peer engine timed in the same run")
    parser.add_argument("--repeat", type=int, default=50, help="timed runs per engine")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs per engine first")
    parser.add_argument("--dim", action="append", metavar="NAME=N", default=[],
                        help="value of a symbolic dim in the random inputs (default 1)")
    add_target_args(parser)
    add_remote_args(parser)
    parser.set_defaults(handler=run)


def run(args) -> int:
    if args.compare and is_artifact(args.model):
        raise GimletError("--compare needs the ONNX model, not an artifact")
    dims = {k: int(v) for k, _, v in (d.partition("=") for d in args.dim)}
    model = model_or_artifact(args.model, args)
    inputs = random_inputs(model.io, dims=dims)
    device = remote_device(args)
    if device is not None:
        if args.compare:
            raise GimletError("--compare runs the peer locally: not with a remote device")
        result = model.remote(device).benchmark(inputs, repeat=args.repeat)
        print(f"on {device.describe()}: {result}")
        return 0
    peer = load_model(args.model) if args.compare else None
    print(latency_report(model, inputs, peer, repeat=args.repeat, warmup=args.warmup))
    return 0


def latency_report(
    model: CompiledModel,
    inputs: Sequence[np.ndarray],
    onnx_model: onnx.ModelProto | None,
    *,
    repeat: int,
    warmup: int,
) -> str:
    """Time `model` (and onnxruntime on `onnx_model`, if given, interleaved) as a table.

    With a peer, outputs are compared first and the largest difference is reported.
    """
    if repeat < 1:
        raise GimletError("--repeat must be at least 1")
    lines = []
    engines = {"gimlet-tvm": lambda: model(*inputs)}
    if onnx_model is not None:
        threads = int(os.environ.get("TVM_NUM_THREADS", os.cpu_count() or 1))
        session = onnxruntime_session(onnx_model, threads)
        feed = dict(zip(model.input_names, inputs))
        diff = max_abs_diff(model(*inputs), session.run(None, feed))
        lines.append(f"max |ours - onnxruntime| over all outputs: {diff:.3g} ({threads} threads each)")
        engines["onnxruntime"] = lambda: session.run(None, feed)
    results = time_interleaved(engines, repeat=repeat, warmup=warmup)
    ours = results["gimlet-tvm"].median_ms
    rows = [
        [name, f"{r.median_ms:.3f}", f"{r.p10_ms:.3f}", f"{r.p90_ms:.3f}", f"{ours / r.median_ms:.2f}"]
        for name, r in results.items()
    ]
    lines.append(format_table(["engine", "median ms", "p10 ms", "p90 ms", "ours/engine"], rows))
    return "\n".join(lines)
