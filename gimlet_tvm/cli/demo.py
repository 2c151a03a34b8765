"""`gimlet-tvm demo`: compile a bundled example model, check it against onnxruntime, time it."""

from __future__ import annotations

import time

import numpy as np

from .. import build
from ..errors import GimletError
from ..models import SUITE
from ..peers import max_abs_diff, onnxruntime_session
from ..targets import DEFAULT_TARGET
from .bench import latency_report

TOLERANCE = 1e-4


def add_parser(sub) -> None:
    parser = sub.add_parser("demo", help="compile and run a bundled example model")
    parser.add_argument("--model", default="transformer_encoder", choices=sorted(SUITE))
    parser.add_argument("-t", "--target", default=DEFAULT_TARGET, help=f"registered target (default {DEFAULT_TARGET})")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=30)
    parser.set_defaults(handler=run)


def run(args) -> int:
    info = SUITE[args.model]
    proto = info.build()
    start = time.perf_counter()
    model = build(proto, args.target)
    print(f"compiled {info.name} for {args.target} in {time.perf_counter() - start:.1f} s")
    inputs = info.example_inputs(batch=args.batch)
    ours = model.run(inputs)
    reference = onnxruntime_session(proto, threads=1).run(None, inputs)
    for name, ref in zip(model.output_names, reference):
        print(f"  output {name}: {ours[name].dtype}{list(ours[name].shape)}")
    diff = max_abs_diff(list(ours.values()), reference)
    scale = max(float(np.max(np.abs(r))) for r in reference)
    ok = all(np.allclose(o, r, rtol=TOLERANCE, atol=TOLERANCE) for o, r in zip(ours.values(), reference))
    print(f"matches onnxruntime (rtol=atol={TOLERANCE}): {'yes' if ok else 'NO'} "
          f"(max abs diff {diff:.2g}, output scale {scale:.2g})")
    print(latency_report(model, list(inputs.values()), proto, repeat=args.repeat, warmup=3))
    if not ok:
        raise GimletError(f"{info.name}: outputs differ from onnxruntime beyond rtol=atol={TOLERANCE}")
    return 0
