"""What the run-time index checks cost (`relax_passes.checked_indexing`): latency with and
without them (`GIMLET_TVM_INDEX_CHECKS=0`), on the models that index with run-time data.

    .venv/bin/python benchmarks/index_checks.py [--repeat 30] [--threads 2]

The suite's models take float inputs and index with none (the pass leaves them unchanged:
the script checks that their kernels are the same both ways). The measured models are a
GPT-2 of transformers exported to ONNX by torch (random weights, GPT-2's widths: token
embedding of 50257 x 768, 2 layers, 128 tokens) and its token-embedding lookup alone, the
worst case (nothing but the checked kernel). Builds alternate, timed runs interleave round
by round, and the medians are printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_models import gpt2_onnx  # noqa: E402  (benchmarks/ is not a package)

# gimlet_tvm (and so TVM) is imported only after main() has pinned the thread count.


def embedding_onnx(vocab: int = 50257, width: int = 768, tokens: int = 128) -> onnx.ModelProto:
    """The token-embedding lookup alone: `input_ids` [1, tokens] -> Gather from the table."""
    table = np.random.default_rng(0).standard_normal((vocab, width)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["wte", "input_ids"], ["rows"])], "embedding",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, tokens])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [1, tokens, width])],
        [onnx.numpy_helper.from_array(table, "wte")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _build(model: onnx.ModelProto, checks: bool):
    from gimlet_tvm import build  # pylint: disable=import-outside-toplevel  (after the threads)
    from gimlet_tvm.compiler import INDEX_CHECKS_ENV  # pylint: disable=import-outside-toplevel
    os.environ[INDEX_CHECKS_ENV] = "1" if checks else "0"
    try:
        return build(model, "llvm")
    finally:
        os.environ.pop(INDEX_CHECKS_ENV)


def _timings(model: onnx.ModelProto, inputs: dict, repeat: int) -> tuple[list[float], list[float]]:
    """ms per run without and with the checks, timed runs interleaved round by round."""
    without, with_ = _build(model, False), _build(model, True)
    np.testing.assert_array_equal(without(*inputs.values())[0], with_(*inputs.values())[0])
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(5):
        without.run(inputs), with_.run(inputs)
    for _ in range(repeat):
        for checked, compiled in ((False, without), (True, with_)):
            start = time.perf_counter()
            compiled.run(inputs)
            times[checked].append((time.perf_counter() - start) * 1e3)
    return times[False], times[True]


def _spread(values: list[float], digits: int = 3) -> str:
    """Median [25th-75th percentile]."""
    low, mid, high = np.percentile(values, [25, 50, 75])
    return f"{mid:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"


def _suite_unchanged() -> list[str]:
    """The suite models, each checked to compile to the same kernels with and without."""
    import tvm  # pylint: disable=import-outside-toplevel
    from gimlet_tvm.compiler import INDEX_CHECKS_ENV, fusion_passes  # pylint: disable=import-outside-toplevel
    from gimlet_tvm.frontend import import_model  # pylint: disable=import-outside-toplevel
    from gimlet_tvm.models import SUITE  # pylint: disable=import-outside-toplevel
    from gimlet_tvm.targets import lookup  # pylint: disable=import-outside-toplevel
    spec, _ = lookup("llvm")
    target = spec.make_target()
    for name, info in SUITE.items():
        mod, _ = import_model(info.build())
        kernels = []
        for value in ("0", "1"):
            os.environ[INDEX_CHECKS_ENV] = value
            with target:
                kernels.append(tvm.transform.Sequential(fusion_passes(spec, target))(mod))
        os.environ.pop(INDEX_CHECKS_ENV)
        tvm.ir.assert_structural_equal(kernels[0], kernels[1])
    return list(SUITE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    print(f"suite models with identical kernels either way: {', '.join(_suite_unchanged())}")
    ids = {"input_ids": np.random.default_rng(0).integers(0, 50257, (1, 128), dtype=np.int64)}
    print("median [25th-75th percentile] of the runs; cost: of the rounds' with/without ratios\n")
    print("| model | without checks (ms) | with checks (ms) | cost (%) |\n|---|---|---|---|")
    for name, model in (("embedding lookup 50257x768, 128 tokens", embedding_onnx()),
                        ("GPT-2 widths, 2 layers, 128 tokens", gpt2_onnx(768, 2, 12, 50257, 128))):
        off, on = _timings(model, ids, args.repeat)
        cost = [100 * (b / a - 1) for a, b in zip(off, on)]
        print(f"| {name} | {_spread(off)} | {_spread(on)} | {_spread(cost, 1)} |", flush=True)


if __name__ == "__main__":
    main()
