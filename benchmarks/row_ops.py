"""Row-wise and elementwise ops of transformers, one op per model, against onnxruntime: layer
norm and softmax (the CPU `Normalization` rule's vector-lane partial sums) and GELU in both
forms (`relax_passes.fast_activations`), at the sizes BERT, GPT-2 and the suite's encoder run
them. Each model is built with `gimlet_tvm.build`, its outputs checked against an onnxruntime
session of the same model, and each engine timed in a block of its own
(`gimlet_tvm.peers.time_interleaved`: warm-up, settling calls before each timed one).

    .venv/bin/python benchmarks/row_ops.py [--threads 2] [--repeat 200]

Prints a Markdown table: median ms (p10-p90) per engine and ours / onnxruntime.
"""

from __future__ import annotations

import argparse
import os
import sys

THREADS = int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 2
for var in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[var] = str(THREADS)

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

import gimlet_tvm  # noqa: E402
from gimlet_tvm.peers import max_abs_diff, onnxruntime_session, time_interleaved  # noqa: E402


def _model(name: str, nodes: list, shape: list[int], consts: dict[str, np.ndarray]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [onnx.numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def layer_norm(rows: int, width: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    return _model(f"layer_norm {rows}x{width}",
                  [helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)], [rows, width],
                  {"g": rng.standard_normal(width), "b": rng.standard_normal(width)})


def softmax(heads: int, rows: int, width: int) -> onnx.ModelProto:
    return _model(f"softmax {heads}x{rows}x{width}", [helper.make_node("Softmax", ["x"], ["y"], axis=-1)],
                  [heads, rows, width], {})


def gelu_erf(rows: int, width: int) -> onnx.ModelProto:
    nodes = [helper.make_node("Div", ["x", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", ["x", "a"], ["m"]),
             helper.make_node("Mul", ["m", "half"], ["y"])]
    return _model(f"gelu (erf) {rows}x{width}", nodes, [rows, width],
                  {"sqrt2": np.sqrt(2), "one": 1, "half": 0.5})


def gelu_tanh(rows: int, width: int) -> onnx.ModelProto:
    nodes = [helper.make_node("Pow", ["x", "three"], ["p"]), helper.make_node("Mul", ["p", "cubic"], ["pc"]),
             helper.make_node("Add", ["x", "pc"], ["s"]), helper.make_node("Mul", ["s", "scale"], ["ss"]),
             helper.make_node("Tanh", ["ss"], ["t"]), helper.make_node("Add", ["t", "one"], ["t1"]),
             helper.make_node("Mul", ["x", "half"], ["xh"]), helper.make_node("Mul", ["xh", "t1"], ["y"])]
    return _model(f"gelu (tanh) {rows}x{width}", nodes, [rows, width],
                  {"three": 3, "cubic": 0.044715, "scale": np.sqrt(2 / np.pi), "one": 1, "half": 0.5})


MODELS = [
    layer_norm(512, 256),  # the suite's encoder, batch 8 x 64 tokens
    layer_norm(128, 768),  # BERT-base / GPT-2 at 128 tokens
    softmax(12, 128, 128),  # BERT-base's attention probabilities
    gelu_erf(128, 3072),  # BERT's FFN
    gelu_tanh(128, 3072),  # GPT-2's FFN
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    print(f"Threads: {args.threads} per engine. Cells: median ms (p10-p90) of {args.repeat} timed calls.\n")
    print("| op | gimlet_tvm ms | onnxruntime ms | ours / onnxruntime |")
    print("|---|---|---|---|")
    for model in MODELS:
        shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
        x = (3 * np.random.default_rng(1).standard_normal(shape)).astype(np.float32)
        ours, session = gimlet_tvm.build(model, "llvm"), onnxruntime_session(model, args.threads)
        diff = max_abs_diff([ours.run({"x": x})["y"]], session.run(None, {"x": x}))
        if diff > 1e-4:
            raise SystemExit(f"{model.graph.name}: ours differs from onnxruntime by {diff}")
        # Each engine in a block of its own: interleaved with onnxruntime, whose workers spin
        # for a while after each call, these sub-millisecond ops of ours waited for a core.
        times = {**time_interleaved({"ours": lambda: ours.run({"x": x})}, repeat=args.repeat),
                 **time_interleaved({"ort": lambda: session.run(None, {"x": x})}, repeat=args.repeat)}
        cell = {k: f"{r.median_ms:.3f} ({r.p10_ms:.3f}-{r.p90_ms:.3f})" for k, r in times.items()}
        print(f"| {model.graph.name} | {cell['ours']} | {cell['ort']} | "
              f"{times['ours'].median_ms / times['ort'].median_ms:.2f} |")


if __name__ == "__main__":
    main()
