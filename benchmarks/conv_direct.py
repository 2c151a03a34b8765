"""Per-shape times of the CPU library's two fp32 conv2d kernels: im2col + OpenBLAS
(`gimlet.cpu.conv2d_nchw`) and the direct blocked kernel (`gimlet.cpu.conv2d_nchw_direct`),
on the conv layers of ResNet-18 (batch 1, 224x224), the suite's resnet_cnn and
mobilenet_cnn (batch 8, 64x64); with --winograd, the direct kernel against Winograd
F(2x2, 3x3) and F(4x4, 3x3) (`gimlet.cpu.conv2d_nchw_winograd`) on the 3x3 stride-1 shapes
(and DenseNet-121's growth convs), each in the layout the default build runs it in: NCHW{B}c
where the input channels are a multiple of this CPU's block (the blocked layout's regions),
else NCHW; GFLOP/s counted as the direct convolution's (2 * 9 * C multiply-adds per output).

    .venv/bin/python benchmarks/conv_direct.py --threads 1 [--repeat 30] [--block 8]
    .venv/bin/python benchmarks/conv_direct.py --threads 1 --winograd
    .venv/bin/python benchmarks/conv_direct.py --threads 1 --models resnet_cnn resnet18_like

With --models, whole suite models instead: built with Winograd (the default rule) and without
(`$GIMLET_CPU_WINOGRAD=0`) and run by onnxruntime, one call each per interleaved round.

    .venv/bin/python benchmarks/conv_direct.py --depthwise --threads 1 [--models mobilenet_cnn ...]

    .venv/bin/python benchmarks/conv_direct.py --blocked --threads 2 --batch 8 --models mobilenet_cnn ...

With --blocked and --models: whole models built three ways, the default rule of the blocked
layout (NCHW{B}c regions, relax_passes/blocked_layout.py), without it
(`$GIMLET_CPU_BLOCKED_LAYOUT=0`) and with it on every function (`=16` or `=8`, this CPU's
block), and onnxruntime.

With --depthwise: the depthwise layers of MobileNetV2 (batch 1, 224x224) and mobilenet_cnn
(batch 8, 64x64), each as a one-conv model (Conv + bias + Clip(0, 6), as in the networks)
built by `gimlet_tvm.build` twice, with the depthwise kernel (`gimlet.cpu.conv2d_nchw_depthwise`,
`$GIMLET_CPU_DEPTHWISE=1`: new) and without it (`=0`: generated TIR, old), interleaved; the
last column says which one the default build uses. With --models too, whole models (suite or
torch_models.py names) built with the default rule, with no depthwise kernel and with every
depthwise conv on it, and onnxruntime.

Calls alternate between the kernels (interleaved rounds), so a load change on the machine
hits both; each row is the median and p10-p90 in ms, and new/old is the ratio of medians.
Each shape is run with a bias + ReLU epilogue, as in the networks. Without --block, the direct
kernel runs with the block the default build would pick (`direct_conv_block_for`, else this
CPU's), and the last column says which kernel the default build uses for the shape.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

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
# DenseNet-121's 3x3 growth convs (batch 1, 224x224): 128 -> 32 in each dense block
DENSENET_GROWTH = [(f"dn 3x3 128-32 {size}", 1, 128, size, 32, 3, 1) for size in (56, 28, 14, 7)]


def interleaved(calls: dict, repeat: int) -> dict[str, list[float]]:
    """Milliseconds per call of each of `calls`, in `repeat` interleaved rounds after 3 warm-up rounds."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(3):
        for call in calls.values():
            call()
    for _ in range(repeat):
        for key, call in calls.items():
            start = time.perf_counter()
            call()
            times[key].append((time.perf_counter() - start) * 1e3)
    return times


def compare_models(names: list[str], batch: int, threads: int, repeat: int, env: str,
                   settings: dict[str, str]) -> None:
    """Whole models (suite names at `batch`, or torch_models.py names) built once per setting
    of the environment variable `env` (`settings`: build name -> value), and onnxruntime,
    through `time_interleaved` (balanced orders, settling calls: each engine's workers spin
    after a call); ratios of the first build to the second and to onnxruntime."""
    # pylint: disable=import-outside-toplevel  (after TVM_NUM_THREADS is set)
    import gimlet_tvm
    from gimlet_tvm.models import SUITE
    from gimlet_tvm.peers import PairedRatio, max_abs_diff, onnxruntime_session, time_interleaved

    first, second = list(settings)[:2]
    print(f"threads {threads}, batch {batch}, {repeat} interleaved rounds; ms median (p10-p90); "
          "ratios: per-round median [p10-p90] (95% interval of the median)")
    print(f"| model | {' ms | '.join(settings)} ms | onnxruntime ms | {first}/{second} | {first}/ort |\n"
          f"|---|{'---|' * len(settings)}---|---|---|")
    for name in names:
        if name in SUITE:
            proto, inputs = SUITE[name].build(), SUITE[name].example_inputs(batch=batch)
        else:
            proto, inputs = TORCH_MODELS[name].onnx(), TORCH_MODELS[name].example_inputs()
        builds = {}
        for key, setting in settings.items():
            os.environ[env] = setting
            builds[key] = gimlet_tvm.build(proto, "llvm")
        os.environ.pop(env)
        session = onnxruntime_session(proto, threads)
        reference = session.run(None, inputs)
        scale = max(np.abs(r).max() for r in reference)
        for key, compiled in builds.items():
            error = max_abs_diff(compiled(*inputs.values()), reference) / scale
            assert error < 1e-3, f"{name} {key}: max error {error:.2e} of the largest output"
        calls = {key: functools.partial(compiled, *inputs.values()) for key, compiled in builds.items()}
        calls["ort"] = functools.partial(session.run, None, inputs)
        results = time_interleaved(calls, repeat=repeat)
        cells = " | ".join(cell(r.samples_ms) for r in results.values())
        print(f"| {name} | {cells} | {PairedRatio.of(results[first], results[second])} | "
              f"{PairedRatio.of(results[first], results['ort'])} |", flush=True)


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
    # pylint: disable=import-outside-toplevel  (after TVM_NUM_THREADS is set)
    import gimlet_tvm
    from gimlet_tvm.relax_passes.dispatch_cpu_library import DEPTHWISE_ENV, depthwise_conv_for

    shapes = [(f"v2 {layer.input_shape[1]}ch {layer.input_shape[2]}px /{layer.stride}", 1,
               layer.input_shape[1], layer.input_shape[2], layer.kernel, layer.stride)
              for layer in conv_layers("mobilenetv2") if layer.groups > 1]
    shapes += [(f"cnn {c}ch {size}px /{stride}", 8, c, size, 3, stride)
               for c, size, stride in MOBILENET_CNN_DEPTHWISE]
    print(f"{repeat} interleaved rounds; ms median (p10-p90)")
    print("| shape | old (TIR) ms | new (library) ms | new/old | default build |\n|---|---|---|---|---|")
    for name, batch, channels, size, kernel, stride in shapes:
        model = _depthwise_model(batch, channels, size, kernel, stride)
        builds = {}
        for key, setting in (("old", "0"), ("new", "1")):
            os.environ[DEPTHWISE_ENV] = setting
            builds[key] = gimlet_tvm.build(model, "llvm")
        os.environ.pop(DEPTHWISE_ENV)
        x = np.random.default_rng(0).standard_normal((batch, channels, size, size), dtype=np.float32)
        np.testing.assert_allclose(builds["new"](x)[0], builds["old"](x)[0], rtol=1e-4, atol=1e-4)
        times = interleaved({key: functools.partial(compiled, x) for key, compiled in builds.items()}, repeat)
        ratio = np.median(times["new"]) / np.median(times["old"])
        used = "library" if depthwise_conv_for(channels, channels, size, 16, None) else "TIR"
        print(f"| {name} | {cell(times['old'])} | {cell(times['new'])} | {ratio:.2f} | {used} |", flush=True)


def to_blocked(x: np.ndarray, block: int) -> np.ndarray:
    """NCHW data (channels a multiple of `block`) as NCHW{block}c."""
    n, c, h, w = x.shape
    return np.ascontiguousarray(x.reshape(n, c // block, block, h, w).transpose(0, 1, 3, 4, 2))


def cell(t: list[float]) -> str:
    return f"{np.median(t):.3f} ({np.percentile(t, 10):.3f}-{np.percentile(t, 90):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--block", type=int, default=0, help="channel block (8 or 16; 0: this CPU's)")
    parser.add_argument("--winograd", action="store_true",
                        help="direct kernel vs Winograd F(2x2) and F(4x4) on the 3x3 stride-1 shapes")
    parser.add_argument("--depthwise", action="store_true",
                        help="depthwise layers: generated TIR vs the library kernel")
    parser.add_argument("--blocked", action="store_true",
                        help="with --models: the blocked layout's default rule vs NCHW vs blocked throughout")
    parser.add_argument("--models", nargs="+", default=[],
                        help="suite (batch: --batch) or torch_models.py models: Winograd (with "
                             "--depthwise: the depthwise kernel's settings) vs onnxruntime")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    if args.depthwise:
        from gimlet_tvm.relax_passes.dispatch_cpu_library import DEPTHWISE_ENV  # pylint: disable=import-outside-toplevel

        depthwise_layers(args.repeat)
        if args.models:
            compare_models(args.models, args.batch, args.threads, args.repeat, DEPTHWISE_ENV,
                           {"default": "", "none": "0", "all": "1"})
        return
    if args.blocked:
        # pylint: disable-next=import-outside-toplevel
        from gimlet_tvm.relax_passes.blocked_layout import BLOCKED_LAYOUT_ENV, direct_conv_block

        compare_models(args.models, args.batch, args.threads, args.repeat, BLOCKED_LAYOUT_ENV,
                       {"default": "", "nchw": "0", "all": str(direct_conv_block())})
        return
    if args.models:
        from gimlet_tvm.relax_passes.dispatch_cpu_library import WINOGRAD_ENV  # pylint: disable=import-outside-toplevel

        compare_models(args.models, args.batch, args.threads, args.repeat, WINOGRAD_ENV,
                       {"winograd": "", "without": "0"})
        return
    import tvm  # pylint: disable=import-outside-toplevel  (after TVM_NUM_THREADS is set)

    from gimlet_tvm.relax_passes.dispatch_cpu_library import (  # pylint: disable=import-outside-toplevel
        ADD_BLOCKED_VECTOR, CONV2D_FUNC, DIRECT_CONV2D_FUNC, RELU, WINOGRAD_CONV2D_FUNC, direct_conv_block,
        direct_conv_block_for, pack_conv_weight, winograd_tile_for, winograd_weight)
    from gimlet_tvm.runtime.extensions import load_extensions  # pylint: disable=import-outside-toplevel

    load_extensions()

    cpu_block = direct_conv_block()
    old, new = tvm.get_global_func(CONV2D_FUNC), tvm.get_global_func(DIRECT_CONV2D_FUNC)
    winograd = tvm.get_global_func(WINOGRAD_CONV2D_FUNC)
    rng = np.random.default_rng(0)
    print(f"threads {args.threads}, this CPU's block {cpu_block}, {args.repeat} interleaved rounds; "
          "ms median (p10-p90)")
    if args.winograd:
        print("| shape | direct ms | F(2x2) ms | F(4x4) ms | GFLOP/s direct / F2 / F4 | F2/direct | "
              "F4/direct | default build |\n|---|---|---|---|---|---|---|---|")
    else:
        print("| shape | block | old ms | new ms | new/old | default build |\n|---|---|---|---|---|---|")
    shapes = SHAPES + DENSENET_GROWTH if args.winograd else SHAPES
    for name, batch, in_c, size, out_c, kernel, stride in shapes:
        if args.winograd and (kernel, stride) != (3, 1):
            continue
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
        params = (stride, stride, pad, pad, 1, 1)
        if args.winograd:
            # The layout the default build runs the conv in (blocked: its data's channels fill
            # whole blocks of this CPU's).
            layout = cpu_block if cpu_block and not in_c % cpu_block and not out_c % cpu_block else 0
            if layout:
                x = tvm.runtime.tensor(to_blocked(x.numpy(), layout))
                w_new = tvm.runtime.tensor(pack_conv_weight(w, layout))
                y = tvm.runtime.tensor(to_blocked(y.numpy(), layout))
                epilogue = (ADD_BLOCKED_VECTOR, bias, out_size * out_size * layout, layout, RELU)
            w2, w4 = (tvm.runtime.tensor(winograd_weight(w, tile, layout)) for tile in (2, 4))
            calls = {
                "direct": lambda: new(x, w_new, *params, *epilogue, y),
                "f2": lambda: winograd(x, w2, *params, *epilogue, y),
                "f4": lambda: winograd(x, w4, *params, *epilogue, y),
            }
            times = interleaved(calls, args.repeat)
            flops = 2 * batch * out_c * out_size * out_size * in_c * kernel * kernel
            rates = " / ".join(f"{flops / np.median(t) / 1e6:.0f}" for t in times.values())
            ratios = [np.median(times[k]) / np.median(times["direct"]) for k in ("f2", "f4")]
            tile = winograd_tile_for(out_c, in_c, (kernel, kernel), (out_size, out_size), cpu_block)
            used = f"Winograd F({tile}x{tile})" if tile else f"direct, block {chosen}" if chosen else "im2col"
            label = f"{name} (blocked)" if layout else name
            print(f"| {label} | {' | '.join(cell(t) for t in times.values())} | {rates} | "
                  f"{ratios[0]:.2f} | {ratios[1]:.2f} | {used} |", flush=True)
            continue
        times = interleaved({
            "old": lambda: old(x, w_old, *params, 1, *epilogue, y),
            "new": lambda: new(x, w_new, *params, *epilogue, y),
        }, args.repeat)
        ratio = np.median(times["new"]) / np.median(times["old"])
        used = f"direct, block {chosen}" if chosen else "im2col"
        print(f"| {name} | {block} | {cell(times['old'])} | {cell(times['new'])} | {ratio:.2f} | {used} |",
              flush=True)


if __name__ == "__main__":
    main()
