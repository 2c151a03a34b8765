"""Per-shape times of the CPU library's two fp32 conv2d kernels: im2col + OpenBLAS
(`gimlet.cpu.conv2d_nchw`) and the direct blocked kernel (`gimlet.cpu.conv2d_nchw_direct`),
on the conv layers of ResNet-18 (batch 1, 224x224), the suite's resnet_cnn and
mobilenet_cnn (batch 8, 64x64).

    .venv/bin/python benchmarks/conv_direct.py --threads 1 [--repeat 30] [--block 8]

Calls alternate between the kernels (interleaved rounds), so a load change on the machine
hits both; each row is the median and p10-p90 in ms, and new/old is the ratio of medians.
Each shape is run with a bias + ReLU epilogue, as in the networks. Without --block, the direct
kernel runs with the block the default build would pick (`direct_conv_block_for`, else this
CPU's), and the last column says which kernel the default build uses for the shape.

    .venv/bin/python benchmarks/conv_direct.py --depthwise --threads 1 [--models mobilenet_cnn ...]

With --depthwise: the depthwise layers of MobileNetV2 (batch 1, 224x224) and mobilenet_cnn
(batch 8, 64x64), each as a one-conv model (Conv + bias + Clip(0, 6), as in the networks)
built by `gimlet_tvm.build` twice, with the depthwise kernel (`gimlet.cpu.conv2d_nchw_depthwise`,
`$GIMLET_CPU_DEPTHWISE=1`: new) and without it (`$GIMLET_CPU_DEPTHWISE=0`: generated TIR, old),
interleaved; the last column says which one the default build uses. --models times whole
models the same way (every other library kernel as in the default build): no depthwise
kernel, the default build's choice, every depthwise conv on it, and onnxruntime.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from unittest import mock

import numpy as np
import onnx
from onnx import TensorProto, helper

from torch_models import TORCH_MODELS, conv_layers  # noqa: E402  (benchmarks/ is not a package)

# (name, batch, in_c, size, out_c, kernel, stride)
SHAPES = [
    ("r18 stem 7x7/2", 1, 3, 224, 64, 7, 2),
    ("r18 l1 3x3", 1, 64, 56, 64, 3, 1),
    ("r18 l2 3x3/2", 1, 64, 56, 128, 3, 2),
    ("r18 l2 3x3", 1, 128, 28, 128, 3, 1),
    ("r18 l2 1x1/2", 1, 64, 56, 128, 1, 2),
    ("r18 l3 3x3/2", 1, 128, 28, 256, 3, 2),
    ("r18 l3 3x3", 1, 256, 14, 256, 3, 1),
    ("r18 l3 1x1/2", 1, 128, 28, 256, 1, 2),
    ("r18 l4 3x3/2", 1, 256, 14, 512, 3, 2),
    ("r18 l4 3x3", 1, 512, 7, 512, 3, 1),
    ("r18 l4 1x1/2", 1, 256, 14, 512, 1, 2),
    ("rcnn stem 3x3", 8, 3, 64, 16, 3, 1),
    ("rcnn 3x3 16", 8, 16, 32, 16, 3, 1),
    ("rcnn 3x3/2 32", 8, 16, 32, 32, 3, 2),
    ("rcnn 3x3 32", 8, 32, 16, 32, 3, 1),
    ("rcnn 3x3/2 64", 8, 32, 16, 64, 3, 2),
    ("rcnn 3x3 64", 8, 64, 8, 64, 3, 1),
    ("mb stem 3x3/2", 8, 3, 64, 16, 3, 2),
    ("mb 1x1 16-32", 8, 16, 32, 32, 1, 1),
    ("mb 1x1 32-64", 8, 32, 16, 64, 1, 1),
    ("mb 1x1 64-64", 8, 64, 16, 64, 1, 1),
    ("mb 1x1 64-128", 8, 64, 8, 128, 1, 1),
    ("mb 1x1 128-128", 8, 128, 8, 128, 1, 1),
]


def interleaved(calls: dict[str, Callable[[], object]], repeat: int, settle: int = 0) -> dict[str, list[float]]:
    """Each call's times in ms over `repeat` rounds that run every call once (after `settle`
    untimed calls of its own, so that another engine's spinning workers have gone quiet:
    benchmarks/README.md, Method), after 3 untimed rounds."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(3):
        for call in calls.values():
            call()
    for _ in range(repeat):
        for key, call in calls.items():
            for _ in range(settle):
                call()
            start = time.perf_counter()
            call()
            times[key].append((time.perf_counter() - start) * 1e3)
    return times


def _cell(t: list[float]) -> str:
    return f"{np.median(t):.3f} ({np.percentile(t, 10):.3f}-{np.percentile(t, 90):.3f})"


# mobilenet_cnn's depthwise layers at batch 8: (channels, input size, stride)
MOBILENET_CNN_DEPTHWISE = [(16, 32, 1), (32, 32, 2), (64, 16, 1), (64, 16, 2), (128, 8, 1)]


def _depthwise_model(batch: int, channels: int, size: int, kernel: int, stride: int) -> onnx.ModelProto:
    """Conv (groups = channels, + bias) + Clip(0, 6), as a MobileNet block's depthwise part."""
    rng, out = np.random.default_rng(channels * size), (size - 1) // stride + 1
    weights = {"w": rng.standard_normal((channels, 1, kernel, kernel), dtype=np.float32),
               "b": rng.standard_normal(channels, dtype=np.float32),
               "lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=channels, strides=[stride] * 2,
                              pads=[kernel // 2] * 4, kernel_shape=[kernel] * 2),
             helper.make_node("Clip", ["c", "lo", "hi"], ["y"])]
    graph = helper.make_graph(
        nodes, "depthwise", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, channels, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, channels, out, out])],
        [onnx.numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def depthwise_layers(repeat: int) -> None:
    """The --depthwise table: each depthwise layer, TIR (old) against the library kernel (new)."""
    import gimlet_tvm  # pylint: disable=import-outside-toplevel  (after TVM_NUM_THREADS is set)
    from gimlet_tvm.relax_passes.dispatch_cpu_library import (  # pylint: disable=import-outside-toplevel
        DEPTHWISE_ENV, depthwise_conv_for)

    shapes = [(f"v2 {layer.input_shape[1]}ch {layer.input_shape[2]}px /{layer.stride}", 1,
               layer.input_shape[1], layer.input_shape[2], layer.kernel, layer.stride)
              for layer in conv_layers("mobilenetv2") if layer.groups > 1]
    shapes += [(f"cnn {c}ch {size}px /{stride}", 8, c, size, 3, stride)
               for c, size, stride in MOBILENET_CNN_DEPTHWISE]
    print("| shape | old (TIR) ms | new (library) ms | new/old | default build |\n|---|---|---|---|---|")
    for name, batch, channels, size, kernel, stride in shapes:
        model = _depthwise_model(batch, channels, size, kernel, stride)
        with mock.patch.dict(os.environ, {DEPTHWISE_ENV: "0"}):
            old = gimlet_tvm.build(model, "llvm")
        with mock.patch.dict(os.environ, {DEPTHWISE_ENV: "1"}):
            new = gimlet_tvm.build(model, "llvm")
        x = np.random.default_rng(0).standard_normal((batch, channels, size, size), dtype=np.float32)
        np.testing.assert_allclose(new(x)[0], old(x)[0], rtol=1e-4, atol=1e-4)
        times = interleaved({"old": lambda: old(x), "new": lambda: new(x)}, repeat)
        ratio = np.median(times["new"]) / np.median(times["old"])
        used = "library" if depthwise_conv_for(channels, channels, size, 16, None) else "TIR"
        print(f"| {name} | {_cell(times['old'])} | {_cell(times['new'])} | {ratio:.2f} | {used} |",
              flush=True)


def depthwise_models(names: list[str], threads: int, repeat: int) -> None:
    """Whole models with the depthwise kernel (new), without it (old) and onnxruntime."""
    import gimlet_tvm  # pylint: disable=import-outside-toplevel
    from gimlet_tvm.models import SUITE  # pylint: disable=import-outside-toplevel
    from gimlet_tvm.peers import onnxruntime_session  # pylint: disable=import-outside-toplevel
    from gimlet_tvm.relax_passes.dispatch_cpu_library import (  # pylint: disable=import-outside-toplevel
        DEPTHWISE_ENV, depthwise_conv_for)

    print("| model | none ms | default ms | all ms | onnxruntime ms | default/none | all/none | "
          "default/onnxruntime |\n|---|---|---|---|---|---|---|---|")
    for name in names:
        if name in SUITE:
            model = SUITE[name].build()
            inputs = SUITE[name].example_inputs(8, seed=0)
        else:
            model, inputs = TORCH_MODELS[name].onnx(), TORCH_MODELS[name].example_inputs(seed=0)
        builds = {}
        for key, value in (("none", "0"), ("default", ""), ("all", "1")):
            with mock.patch.dict(os.environ, {DEPTHWISE_ENV: value}):
                builds[key] = gimlet_tvm.build(model, "llvm")
        session = onnxruntime_session(model, threads)
        values = list(inputs.values())
        for compiled in builds.values():
            np.testing.assert_allclose(compiled(*values)[0], builds["none"](*values)[0], rtol=1e-3, atol=1e-3)
        calls = {key: (lambda c=compiled: c(*values)) for key, compiled in builds.items()}
        times = interleaved(calls | {"ort": lambda: session.run(None, inputs)}, repeat, settle=3)
        m = {k: np.median(t) for k, t in times.items()}
        print(f"| {name} | {' | '.join(_cell(t) for t in times.values())} | {m['default'] / m['none']:.2f} | "
              f"{m['all'] / m['none']:.2f} | {m['default'] / m['ort']:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--block", type=int, default=0, help="channel block (8 or 16; 0: this CPU's)")
    parser.add_argument("--depthwise", action="store_true", help="depthwise layers, TIR against the library")
    parser.add_argument("--models", nargs="*", default=[], help="with --depthwise: whole models too")
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    if args.depthwise:
        print(f"threads {args.threads}, {args.repeat} interleaved rounds; ms median (p10-p90)")
        depthwise_layers(args.repeat)
        if args.models:
            depthwise_models(args.models, args.threads, args.repeat)
        return
    import tvm  # pylint: disable=import-outside-toplevel  (after TVM_NUM_THREADS is set)

    from gimlet_tvm.relax_passes.dispatch_cpu_library import (  # pylint: disable=import-outside-toplevel
        CONV2D_FUNC, DIRECT_CONV2D_FUNC, direct_conv_block, direct_conv_block_for, pack_conv_weight)
    from gimlet_tvm.runtime.extensions import load_extensions  # pylint: disable=import-outside-toplevel

    load_extensions()

    cpu_block = direct_conv_block()
    old, new = tvm.get_global_func(CONV2D_FUNC), tvm.get_global_func(DIRECT_CONV2D_FUNC)
    rng = np.random.default_rng(0)
    print(f"threads {args.threads}, this CPU's block {cpu_block}, {args.repeat} interleaved rounds; "
          "ms median (p10-p90)")
    print("| shape | block | old ms | new ms | new/old | default build |\n|---|---|---|---|---|---|")
    for name, batch, in_c, size, out_c, kernel, stride in SHAPES:
        chosen = direct_conv_block_for(out_c, in_c, (kernel, kernel), cpu_block)
        block = args.block or chosen or cpu_block
        pad = kernel // 2
        out_size = (size + 2 * pad - kernel) // stride + 1
        x = tvm.runtime.tensor(rng.standard_normal((batch, in_c, size, size), dtype=np.float32))
        w = rng.standard_normal((out_c, in_c, kernel, kernel), dtype=np.float32)
        bias = tvm.runtime.tensor(rng.standard_normal(out_c, dtype=np.float32))
        w_old, w_new = tvm.runtime.tensor(w), tvm.runtime.tensor(pack_conv_weight(w, block))
        y = tvm.runtime.tensor(np.zeros((batch, out_c, out_size, out_size), np.float32))
        epilogue = (0, bias, out_size * out_size, 2)
        calls = {
            "old": lambda: old(x, w_old, stride, stride, pad, pad, 1, 1, 1, *epilogue, y),
            "new": lambda: new(x, w_new, stride, stride, pad, pad, 1, 1, *epilogue, y),
        }
        times = interleaved(calls, args.repeat)
        cells = [_cell(t) for t in times.values()]
        ratio = np.median(times["new"]) / np.median(times["old"])
        used = f"direct, block {chosen}" if chosen else "im2col"
        print(f"| {name} | {block} | {cells[0]} | {cells[1]} | {ratio:.2f} | {used} |", flush=True)


if __name__ == "__main__":
    main()
