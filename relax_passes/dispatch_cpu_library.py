"""Hand fp32 matmul, NCHW conv2d (with their elementwise epilogues) and attention to gimlet's
OpenBLAS-backed CPU library.

1. Put the pass before LegalizeOps: it rewrites high-level Relax ops, which legalization
   would otherwise turn into TIR.
2. It rewrites
   - `R.matmul(a, b)` and `R.matmul(a, R.permute_dims(w))` (a transpose of the last two axes)
     into `R.call_dps_packed("gimlet.cpu.matmul", (a, b_or_w, transpose_b))`, for float32
     operands of rank >= 2 with any (also symbolic) batch axes that broadcast; a one-row `a`
     (a classifier at batch 1) by a constant 2-D `b` gets `b` transposed here, at build time,
     so the library runs N dot products, each of B's rows read once in order, instead of
     OpenBLAS's GEMV over [K, N] (faster on classifiers' weights: benchmarks/README.md, "NCHW
     tiles transposed, ...");
   - `R.nn.conv2d` with NCHW data, OIHW weights and NCHW output into
     `R.call_dps_packed("gimlet.cpu.conv2d_nchw", (data, weight, strides, pads, dilations,
     groups))`, for float32 and any `groups` except depthwise (with `grouping`, kernel
     selection's run, every conv2d stays that call: one op group); else with `groups` 1, also
     in such calls a grouping run wrote, into the call of the first conv algorithm of
     `CONV_ALGORITHMS` that can run the shape and whose rule wants it (`default_conv_algorithm`;
     kernel selection offers each algorithm as a candidate and emits its call itself, through
     the same registry):
     `winograd4` / `winograd2`: for a 3x3 kernel, stride 1, dilation 1 and a constant weight,
     where `winograd_tile_for` says so (`$GIMLET_CPU_WINOGRAD` overrides the rule), the
     Winograd kernel `R.call_dps_packed("gimlet.cpu.conv2d_nchw_winograd", (data, u, strides,
     pads, dilations))`, `u` the weight transformed for F(m x m, 3 x 3) by numpy in the pass
     (`winograd_weight`: once, at build time; kernel selection, whose checks pass the weight
     as a parameter, gets the same transform as an `R.einsum` in float32);
     `direct16` / `direct8`: where `direct_conv_block_for` says so, the direct kernel
     `R.call_dps_packed("gimlet.cpu.conv2d_nchw_direct", (data, packed, strides, pads,
     dilations))`, `packed` being the weight as `R.layout_transform` into blocks of 16 or 8
     output channels (`pack_conv_weight`), which FoldConstant computes at build time for a
     constant weight. The block is this CPU's vector width (`direct_conv_block`, which
     `$GIMLET_CPU_CONV_BLOCK` overrides: 8 forces the AVX2 kernel, 0 turns the direct
     kernel off), or 8 where that makes two blocks of a 16-channel conv;
     `rows`: a kernel larger than 1x1 and fewer than 32 multiply-adds per output
     (`row_conv_for`: 3-channel stems), the row-vectorized kernel `R.call_dps_packed(
     "gimlet.cpu.conv2d_nchw_rows", (data, weight, strides, pads, dilations, lanes))`;
     `im2col`: never by the rule (the generic call is that kernel); chosen by kernel
     selection, the same function under its own name, `gimlet.cpu.conv2d_nchw_im2col`, which
     this pass then leaves alone. All but im2col need AVX2 (`direct16`: AVX-512) and a build
     for this machine;
   - depthwise `R.nn.conv2d` (one group per input channel, weight [O, 1, KH, KW]; not with
     `grouping`), where `depthwise_conv_for` says so (inputs at least 112 wide;
     `$GIMLET_CPU_DEPTHWISE` 1 or 0: all or none), into `R.call_dps_packed(
     "gimlet.cpu.conv2d_nchw_depthwise", (data, weight, strides, pads, dilations, lanes))`;
   - `R.nn.conv2d` on channel-blocked data and output (`data_layout` and `out_layout`
     "NCHW{B}c", OIHW weight: what `blocked_layout.BlockedLayout` writes; also with
     `grouping`, where nothing else could run it), or with one of them blocked and the other
     NCHW (an entry or exit conv, groups 1): groups 1, and groups of whole channel blocks on
     blocked data and output (each group run as an image of its own), into the direct kernel
     (`R.call_dps_packed("gimlet.cpu.conv2d_nchw_direct", (data, packed, strides, pads,
     dilations))`, the weight packed as above with block B; 1x1 stride-1 convs run as GEMM
     tiles; groups 1 on data bound to `x * scale`, a per-channel scale shared by the images (a
     squeeze-and-excitation gate at batch 1), into `R.call_dps_packed(
     "gimlet.cpu.conv2d_nchw_direct_scaled", (x, scale, packed, ...))`, which scales the
     weight's input channels instead of the data, where the weight is at most a quarter of
     its size) or, both blocked and groups 1 where more than one of `CONV_ALGORITHMS` can run
     it (a 3x3 stride-1 conv with a constant weight: the Winograd kernels, its weight
     transformed at build time as [alpha^2, I / B, B, O] by `winograd_weight` with the block,
     and the direct one), first into the generic `R.call_dps_packed("gimlet.cpu.conv2d_nchwc",
     (data, weight, strides, pads, dilations, groups))` (with `grouping`, an op group kernel
     selection chooses an algorithm for, else at once) and from it into the algorithm the
     default rule picks, as for NCHW; depthwise into `R.call_dps_packed(
     "gimlet.cpu.conv2d_nchwc_depthwise", (data, packed, strides, pads, dilations))`;
   - `R.nn.max_pool2d` on NCHW{B}c data (B 8 or 16, static attributes) into
     `R.call_dps_packed("gimlet.cpu.max_pool2d_nchwc", (data, strides, pads, dilations,
     pool size))`, each pixel's channels one vector;
   - `R.nn.attention` (BSNH, optional 4-D bias, no causal mask or window; what
     `FuseAttention` emits) into `R.call_dps_packed("gimlet.cpu.attention", (q, k, v[, bias],
     scale))`, for float32;
   - epilogues of those matmul and conv2d calls (all conv2d kernels), into the same call: an
     `R.add` of a tensor of the output's shape (residual) or of a tensor broadcast along one
     axis (bias, any scalar) or, for a 5-D output [N, C / B, H, W, B], along axes 1 and 4 (a
     blocked per-channel bias: `ADD_BLOCKED_VECTOR`, applied on vectors), `R.nn.relu`,
     `R.nn.gelu`, `R.nn.silu` (what `FuseSiLU` makes of x * sigmoid(x)), `R.sigmoid`, and
     `R.maximum` / `R.minimum` with a scalar constant (a clip step; a maximum followed by a
     minimum, as the ONNX importer writes Clip and ReLU6, is one), `x * hard_sigmoid(x)`
     (hard-swish, as the importer writes ONNX HardSwish or HardSigmoid times x: the chain
     `hard_sigmoid_input` recognizes), in any order and number, when the call's result has
     no other use (a hard-swish: but its gate). The library applies them to each output
     block right after computing it.
   Epilogues are not fused within `graph_fusion.graph_fusion_disabled()`.
   Only calls on the host are rewritten: tensors without a virtual device, or with one whose
   target's spec lists the CPU library.
3. It does not handle: other dtypes or mixed-precision `out_dtype`, rank-1 matmul operands,
   transposes of other axes than the last two, layouts other than NCHW and NCHW{B}c (blocked
   convs with a weight in another layout than OIHW), NCHW depthwise conv2d on smaller
   inputs or a CPU without AVX2 (it stays in TIR, where FuseOps fuses its epilogue: there it
   ran faster), and operands or results whose shape is unknown; epilogue adds that broadcast
   the output or whose vector axis is followed by symbolic axes; other activations (tanh,
   ...). Those ops stay as they were, and FuseOps fuses the elementwise ones with each other.

The packed functions come from `runtime/ext/cpu_library.cc`. The pass loads that extension
(building it on first use), so the functions exist when the module is built and run in this
process; another process running the compiled module must load it too (`gimlet_tvm.runtime`).
`library_dispatch` runs it for the targets whose spec lists `targets.libraries.CPU_LIBRARY`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from typing import Callable

import numpy as np
import tvm
from tvm import IRModule, relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..errors import CompileError
from ..runtime.extensions import load_extensions
from ..targets import spec_for
from ..targets.libraries import CPU_LIBRARY
from .graph_fusion import graph_fusion_enabled

MATMUL_FUNC = f"{CPU_LIBRARY.name}.matmul"
CONV2D_FUNC = f"{CPU_LIBRARY.name}.conv2d_nchw"
# A groups-1 conv on NCHW{B}c data and output with a choice of algorithms, as the grouping run
# writes it for kernel selection: no library function; the library pass always rewrites it.
BLOCKED_CONV2D_FUNC = f"{CPU_LIBRARY.name}.conv2d_nchwc"
IM2COL_CONV2D_FUNC = f"{CPU_LIBRARY.name}.conv2d_nchw_im2col"  # the same kernel, chosen
DIRECT_CONV2D_FUNC = f"{CPU_LIBRARY.name}.conv2d_nchw_direct"
SCALED_DIRECT_CONV2D_FUNC = f"{CPU_LIBRARY.name}.conv2d_nchw_direct_scaled"
ROW_CONV2D_FUNC = f"{CPU_LIBRARY.name}.conv2d_nchw_rows"
DEPTHWISE_CONV2D_FUNC = f"{CPU_LIBRARY.name}.conv2d_nchw_depthwise"
BLOCKED_DEPTHWISE_CONV2D_FUNC = f"{CPU_LIBRARY.name}.conv2d_nchwc_depthwise"
DEPTHWISE_ENV = "GIMLET_CPU_DEPTHWISE"
DIRECT_CONV_BLOCK_ENV = "GIMLET_CPU_CONV_BLOCK"
WINOGRAD_CONV2D_FUNC = f"{CPU_LIBRARY.name}.conv2d_nchw_winograd"
WINOGRAD_ENV = "GIMLET_CPU_WINOGRAD"
ATTENTION_FUNC = f"{CPU_LIBRARY.name}.attention"
BLOCKED_MAX_POOL_FUNC = f"{CPU_LIBRARY.name}.max_pool2d_nchwc"
# Where each function's epilogue arguments start: after (a, b, transpose_b); after (data,
# weight, 6 params, groups) for both names of the im2col kernel and the blocked generic call;
# after (data, packed weight, 6 params); after (data, scale, packed weight, 6 params); after
# (data, weight, 6 params, lanes) for the row and depthwise kernels; after (data, transformed
# or blocked weight, 6 params) for the Winograd and blocked depthwise kernels.
_EPILOGUE_START = {MATMUL_FUNC: 3, CONV2D_FUNC: 9, IM2COL_CONV2D_FUNC: 9, BLOCKED_CONV2D_FUNC: 9,
                   DIRECT_CONV2D_FUNC: 8,
                   SCALED_DIRECT_CONV2D_FUNC: 9, ROW_CONV2D_FUNC: 9, DEPTHWISE_CONV2D_FUNC: 9,
                   WINOGRAD_CONV2D_FUNC: 8, BLOCKED_DEPTHWISE_CONV2D_FUNC: 8}

# Epilogue step kinds, as `runtime/ext/cpu_library.cc` reads them.
ADD_VECTOR, ADD_TENSOR, RELU, CLIP, GELU, ADD_BLOCKED_VECTOR, SILU, SIGMOID, HARD_SWISH = 0, 1, 2, 3, 4, 5, 6, 7, 8
ACTIVATIONS = {"relax.nn.relu": RELU, "relax.nn.gelu": GELU, "relax.nn.silu": SILU, "relax.sigmoid": SIGMOID}
# Ops by a scalar constant a hard-sigmoid chain is made of (`hard_sigmoid_input`), beside
# `R.clip`: affine steps, and bounds.
_SCALAR_OPS = ("relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum")


@tvm.transform.module_pass(opt_level=0, name="DispatchCPULibrary")
class DispatchCPULibrary:  # pylint: disable=too-few-public-methods
    """Rewrite fp32 matmul, NCHW conv2d (with epilogues) and attention into calls of gimlet's
    CPU library. With `grouping`, every conv2d stays the generic `gimlet.cpu.conv2d_nchw` call
    (OIHW weight, one op group for kernel selection, whatever kernel would run it); without,
    groups-1 convs, also those of generic calls a grouping run wrote, go to the Winograd,
    direct or row-vectorized kernel where it wins."""

    def __init__(self, grouping: bool = False, host: bool = True):
        """`host`: the module is compiled for this machine's CPU. The conv kernels are chosen
        by this CPU's instruction sets (AVX2, AVX-512), so a cross-compiled module (another
        CPU) gets the generic conv2d call only."""
        self.grouping = grouping
        self.host = host

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        """IRModule-level transformation."""
        load_extensions()
        rewriter = _LibraryCallRewriter(mod)
        rewriter.fuse_epilogues = graph_fusion_enabled()
        rewriter.conv_kernels = not self.grouping
        rewriter.direct_block = direct_conv_block() if self.host else 0
        rewriter.winograd = winograd_override()
        rewriter.depthwise_wanted = depthwise_kernel_wanted()
        for g_var, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.use_counts = variable_uses(func)
                func = rewriter.visit_expr(func)
                # Transposes and calls folded into calls are now unused.
                rewriter.builder_.update_func(g_var, relax.analysis.remove_all_unused(func))
        kernels = _BlockedConvKernels(rewriter.builder_.get())
        kernels.choose = not self.grouping
        kernels.direct_block, kernels.winograd = rewriter.direct_block, rewriter.winograd
        for g_var, func in kernels.builder_.get().functions_items():
            if isinstance(func, relax.Function):
                kernels.in_place = in_place_concat_convs(func)
                kernels.builder_.update_func(g_var, kernels.visit_expr(func))
        return kernels.builder_.get()


def direct_conv_block() -> int:
    """Output channels per block of the direct conv2d kernel on this CPU: 16 with AVX-512, 8
    with AVX2 and FMA, 0 without (no direct kernel); `$GIMLET_CPU_CONV_BLOCK` (8, 16 or 0)
    overrides it, e.g. to run the AVX2 kernel on an AVX-512 machine."""
    override = os.environ.get(DIRECT_CONV_BLOCK_ENV, "").strip()
    if override:
        if override not in ("0", "8", "16"):
            raise CompileError(f"${DIRECT_CONV_BLOCK_ENV} must be 0, 8 or 16, not {override!r}")
        return int(override)
    load_extensions()
    return int(tvm.get_global_func(f"{CPU_LIBRARY.name}.conv2d_direct_block")())


def pack_conv_weight(weight: np.ndarray, block: int) -> np.ndarray:
    """An OIHW weight in the direct kernel's layout [ceil(O / block), I, H, W, block]: output
    channel o at [o // block, ..., o % block], zero past O (what the pass's layout_transform
    computes)."""
    out_c = weight.shape[0]
    blocks = -(-out_c // block)
    padded = np.zeros((blocks * block, *weight.shape[1:]), weight.dtype)
    padded[:out_c] = weight
    return np.ascontiguousarray(padded.reshape(blocks, block, *weight.shape[1:]).transpose(0, 2, 3, 4, 1))


def direct_conv_block_for(out_c: int, in_c: int, kernel: tuple[int, int], cpu_block: int) -> int:
    """The channel block the direct kernel runs a groups-1 conv2d of that shape with, where it
    beats im2col + OpenBLAS; 0 where it does not (or `cpu_block`, this CPU's, is 0).

    benchmarks/conv_direct.py on Zen 4 (AVX-512, 1 and 2 threads): convs of at least 32
    multiply-adds per output (ResNet-18's, resnet_cnn's but its stem) ran in 0.3-0.9x the
    time; 1x1 convs are plain GEMMs, where OpenBLAS's packed kernels did as well or better
    (0.8-2.2x), and so did the 3-channel stems (27 multiply-adds per output: 0.8-1.2x). On an
    AVX-512 Xeon, a conv with fewer channels than the CPU's block ran on the narrower block in
    0.86x im2col's time (8 channels), and since one block's tiles hold 24 pixels, 16-channel
    convs run on one 16-channel block (resnet_cnn's 16->16: 0.8x two 8-channel blocks)."""
    if tuple(kernel) == (1, 1) or in_c * kernel[0] * kernel[1] < 32:
        return 0
    for block in (cpu_block, 8):
        if 0 < block <= cpu_block and out_c >= block:
            return block
    return 0


# G of Winograd F(m x m, 3 x 3) per tile size m (the points of the kernel's B^T and A^T: 0,
# 1, -1, infinity, and 2, -2 for m = 4).
_WINOGRAD_G = {
    2: np.array([[1, 0, 0], [1 / 2, 1 / 2, 1 / 2], [1 / 2, -1 / 2, 1 / 2], [0, 0, 1]]),
    4: np.array([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
                 [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]]),
}


def winograd_weight(weight: np.ndarray, tile: int, block: int = 0) -> np.ndarray:
    """An OIHW 3x3 weight transformed for `gimlet.cpu.conv2d_nchw_winograd` with m x m output
    tiles (`tile` 2 or 4): U = G g G^T per (output, input) channel pair, in float64, as float32
    [alpha^2, O, I] (alpha = tile + 2); for channel-blocked data (`block` B, not 0), transposed
    as [alpha^2, I / B, B, O]."""
    if tile not in _WINOGRAD_G or weight.shape[2:] != (3, 3):
        raise CompileError(f"no Winograd transform for tile {tile} and kernel {weight.shape[2:]}")
    g = _WINOGRAD_G[tile]
    out_c, in_c = weight.shape[:2]
    if block:
        u = np.einsum("ak,oikl,bl->abio", g, weight.astype(np.float64), g)
        return np.ascontiguousarray(u.reshape(-1, in_c // block, block, out_c).astype(np.float32))
    u = np.einsum("ak,oikl,bl->aboi", g, weight.astype(np.float64), g)
    return np.ascontiguousarray(u.reshape(-1, out_c, in_c).astype(np.float32))


def winograd_override() -> int | None:
    """The Winograd tile `$GIMLET_CPU_WINOGRAD` sets for every 3x3 stride-1 dilation-1 groups-1
    conv2d with a constant weight (2 or 4; 0: Winograd off), for A/B measurements; None where it
    is unset (`winograd_tile_for` decides)."""
    override = os.environ.get(WINOGRAD_ENV, "").strip()
    if not override:
        return None
    if override not in ("0", "2", "4"):
        raise CompileError(f"${WINOGRAD_ENV} must be 0, 2 or 4, not {override!r}")
    return int(override)


# The most bytes of transformed F(4x4) weight (36 * O * C floats) per 4x4 output tile of an
# image for which F(4x4) beats the direct kernel (see `winograd_tile_for`).
_F4_WEIGHT_BYTES_PER_TILE = 256 * 1024


def winograd_tile_for(out_c: int, in_c: int, kernel: tuple[int, int], out_hw: tuple[int, int],
                      cpu_block: int) -> int:
    """The output tile m (2 or 4) of the Winograd F(m x m, 3 x 3) kernel for a 3x3 conv2d that
    is stride 1, dilation 1 and groups 1 (the caller checks those), where it beats the direct
    kernel; 0 where it does not (and on a CPU without the direct kernel, `cpu_block` 0, where
    it was not measured).

    F(4x4) does 4x fewer multiply-adds than the direct kernel, in GEMMs over the channels, but
    transforms every input and output tile (work per tile in proportion to C + O, against the
    GEMMs' C * O) and reads a transformed weight 4x the kernel's size per call. So it pays
    where both channel counts are at least 32 and the weight is read for enough tiles: at most
    256 KiB of it per 4x4 output tile of one image (a batch only adds tiles).
    benchmarks/conv_direct.py --winograd (blocked kernels, 2 threads, Intel Xeon with AVX-512;
    benchmarks/README.md, "A Winograd rule from the blocked kernels"): F(4x4) took 0.56-0.90x
    the direct kernel's time on ResNet-18's 64-channel 56x56 and 128-channel 28x28 convs (3
    and 47 KiB a tile), resnet_cnn's 32- and 64-channel ones (9 and 144 KiB) and DenseNet-121's
    128 -> 32 growth convs at 56x56 to 7x7 (144 KiB at 7x7); 1.35x on the 256-channel 14x14
    conv (576 KiB), 4.7x at 512 channels 7x7 (9 MiB), and 1.15x on resnet_cnn's 16-channel
    convs (transforms too large a share). F(2x2) was never the fastest with AVX-512 (the
    direct kernel's 14-pixel row tiles tie it at 14x14); with the AVX2 kernels (`cpu_block`
    8) it took 0.56x the direct kernel's time on the 256-channel 14x14 conv (F(4x4) 0.73x), so
    there it serves the 14x14-or-larger planes of at least 128 channels that F(4x4) does not."""
    if tuple(kernel) != (3, 3) or cpu_block == 0:
        return 0
    channels, tiles = min(in_c, out_c), -(-out_hw[0] // 4) * -(-out_hw[1] // 4)
    if channels >= 32 and 36 * in_c * out_c * 4 <= _F4_WEIGHT_BYTES_PER_TILE * tiles:
        return 4
    return 2 if cpu_block < 16 and channels >= 128 and out_hw[0] * out_hw[1] >= 14 * 14 else 0


def row_conv_for(in_c: int, kernel: tuple[int, int], cpu_block: int) -> bool:
    """Whether a groups-1 conv2d of that shape runs on the row-vectorized kernel
    (`gimlet.cpu.conv2d_nchw_rows`): one with a kernel larger than 1x1 and fewer than 32
    multiply-adds per output (3-channel stems), where the direct kernel's per-tile scatter into
    NCHW and im2col's column matrix cost more than the multiply-adds, on a CPU with a direct
    kernel (`cpu_block` not 0). The call asks for vectors of `cpu_block` lanes (16: AVX-512, 8:
    AVX2); where it runs, a CPU without AVX-512 uses 8.
    benchmarks/README.md, "The direct convolution kernel", has the measurements."""
    return cpu_block > 0 and tuple(kernel) != (1, 1) and in_c * kernel[0] * kernel[1] < 32


@dataclasses.dataclass(frozen=True)
class ConvShape:
    """What the conv algorithms read of a conv2d: output channels, input channels per group,
    kernel (h, w), output (h, w) (None where symbolic), `params` (strides (h, w), top and left
    padding, dilations (h, w)), groups, whether the weight is a constant, and the channel
    block B of NCHW{B}c data and output (0: NCHW)."""

    out_c: int
    in_c: int
    kernel: tuple[int, int]
    out_hw: tuple[int, int] | None
    params: tuple[int, ...]
    groups: int
    constant_weight: bool
    block: int = 0


def conv_shape(call: relax.Call) -> ConvShape | None:
    """The shape of a `gimlet.cpu.conv2d_nchw` or `.conv2d_nchwc` call (generic, OIHW weight);
    None where its weight's or block's extent is symbolic."""
    data, weight, *params = call.args[1].fields
    weight_shape = _static_ints(weight.ty.shape)
    block = _static_ints([data.ty.shape[4]]) if data.ty.ndim == 5 else [0]
    if weight_shape is None or block is None:
        return None
    out_shape = call.ty_args[0].shape  # the call's output (it may not be normalized yet)
    out_hw = _static_ints([out_shape[2], out_shape[3]])
    out_c, in_c, kh, kw = weight_shape
    return ConvShape(out_c, in_c, (kh, kw), None if out_hw is None else tuple(out_hw),
                     tuple(int(p.value) for p in params[:6]), int(params[6].value),
                     isinstance(weight, tvm.ir.GenericConst), block[0])


@dataclasses.dataclass(frozen=True)
class ConvAlgorithm:
    """One of the CPU library's kernels for NCHW conv2d. `unavailable(shape, cpu_block)`: why it
    cannot run that shape on a CPU whose direct-kernel block is `cpu_block` (0: no AVX2, or a
    build for another CPU), None where it can; `wanted(shape, cpu_block, winograd)`: whether
    the default rule picks it (`winograd`: `$GIMLET_CPU_WINOGRAD`'s tile or None); `emit(bb,
    call, cpu_block)`: its call for a generic `gimlet.cpu.conv2d_nchw` or `.conv2d_nchwc` call
    (epilogue kept)."""

    name: str
    func: str
    unavailable: Callable[[ConvShape, int], str | None]
    wanted: Callable[[ConvShape, int, int | None], bool]
    emit: Callable[[relax.BlockBuilder, relax.Call, int], relax.Expr]


# What a direct-kernel channel block needs of the CPU.
_BLOCK_NEEDS = {8: "AVX2 and FMA", 16: "AVX-512"}


def _groups_1(shape: ConvShape) -> str | None:
    return None if shape.groups == 1 else "groups 1 only"


def _vector_kernel(shape: ConvShape, cpu_block: int, block: int = 8) -> str | None:
    """Why a groups-1 kernel with `block`-wide vectors cannot run the shape, if it cannot."""
    if cpu_block < block:
        return f"needs {_BLOCK_NEEDS[block]} on the CPU, in a build for this machine"
    return _groups_1(shape)


def _nchw_kernel(shape: ConvShape, cpu_block: int) -> str | None:
    """Why a groups-1 vector kernel of NCHW data only cannot run the shape, if it cannot."""
    return "NCHW data only" if shape.block else _vector_kernel(shape, cpu_block)


def _split_args(call: relax.Call) -> tuple[relax.Expr, relax.Expr, list[relax.Expr], list[relax.Expr]]:
    """(data, weight, the 6 conv params, epilogue arguments) of a generic conv call."""
    data, weight, *args = call.args[1].fields
    return data, weight, args[:6], args[7:]


def _winograd(tile: int) -> ConvAlgorithm:
    """Winograd F(tile x tile, 3 x 3), its weight transformed here by numpy (`winograd_weight`)."""
    def unavailable(shape: ConvShape, cpu_block: int) -> str | None:
        if shape.kernel != (3, 3) or shape.params[0:2] != (1, 1) or shape.params[4:6] != (1, 1):
            return "3x3 kernel, stride 1 and dilation 1 only"
        if not shape.constant_weight:
            return "needs a constant weight (transformed at build time)"
        if shape.out_hw is None:
            return "needs a static output size"
        return _vector_kernel(shape, cpu_block)

    def wanted(shape: ConvShape, cpu_block: int, winograd: int | None) -> bool:
        if winograd is not None:
            return winograd == tile
        return winograd_tile_for(shape.out_c, shape.in_c, shape.kernel, shape.out_hw, cpu_block) == tile

    def emit(bb: relax.BlockBuilder, call: relax.Call, cpu_block: int) -> relax.Expr:
        data, weight, params, epilogue = _split_args(call)
        block = int(data.ty.shape[4]) if data.ty.ndim == 5 else 0
        return winograd_call(bb, data, weight, [*params, *epilogue], call.ty_args[0], tile, block)

    return ConvAlgorithm(f"winograd{tile}", WINOGRAD_CONV2D_FUNC, unavailable, wanted, emit)


def winograd_call(bb: relax.BlockBuilder, data: relax.Expr, weight: relax.Expr, args: list[relax.Expr],
                  out_ty: relax.Type, tile: int, block: int = 0) -> relax.Expr:
    """The Winograd kernel's call on `data` (NCHW, or NCHW{B}c with `block` B, as `out_ty`) with
    an OIHW `weight` transformed for F(tile x tile, 3 x 3) (`winograd_weight`'s layouts): by
    numpy here for a constant, else (a weight kernel selection's checks pass as a parameter) by
    the same transform in float32; `args`: the 6 conv params and the epilogue."""
    if isinstance(weight, tvm.ir.GenericConst):
        transformed = relax.const(winograd_weight(weight.value.numpy(), tile, block))
    else:
        g = relax.const(_WINOGRAD_G[tile].astype(np.float32))
        out_c, in_c = weight.ty.shape[0], weight.ty.shape[1]
        u = bb.emit(relax.op.einsum((g, weight, g), "ak,oikl,bl->abio" if block else "ak,oikl,bl->aboi"))
        shape = (in_c // block, block, out_c) if block else (out_c, in_c)
        transformed = bb.emit(relax.op.reshape(u, ((tile + 2) ** 2, *shape)))
    return relax.call_dps_packed(WINOGRAD_CONV2D_FUNC, [data, transformed, *args], out_ty)


def packed_conv_weight(bb: relax.BlockBuilder, weight: relax.Expr, block: int) -> relax.Expr:
    """An OIHW weight as the direct and blocked depthwise kernels take it, [ceil(O / block), I,
    H, W, block] (`pack_conv_weight`'s layout), emitted as a `layout_transform` that
    FoldConstant computes at build time for a constant weight."""
    return bb.emit(relax.op.layout_transform(
        weight, lambda o, i, h, w: (o // block, i, h, w, o % block), pad_value=0.0))


def _direct(block: int) -> ConvAlgorithm:
    """The direct kernel with blocks of `block` output channels, the weight packed for it by a
    `layout_transform` (FoldConstant computes it at build time for a constant weight); on
    blocked data, the data's block only, and there always wanted (where no Winograd is)."""
    def unavailable(shape: ConvShape, cpu_block: int) -> str | None:
        if shape.block not in (0, block):
            return f"{block}-channel blocks, not the data's {shape.block}"
        # On blocked data the library runs the data's block with any vectors it has.
        return _vector_kernel(shape, cpu_block, 8 if shape.block else block)

    def wanted(shape: ConvShape, cpu_block: int, _winograd: int | None) -> bool:
        return shape.block == block or direct_conv_block_for(shape.out_c, shape.in_c, shape.kernel, cpu_block) == block

    def emit(bb: relax.BlockBuilder, call: relax.Call, cpu_block: int) -> relax.Expr:
        data, weight, params, epilogue = _split_args(call)
        packed = packed_conv_weight(bb, weight, block)
        return relax.call_dps_packed(DIRECT_CONV2D_FUNC, [data, packed, *params, *epilogue], call.ty_args[0])

    return ConvAlgorithm(f"direct{block}", DIRECT_CONV2D_FUNC, unavailable, wanted, emit)


def _emit_rows(bb: relax.BlockBuilder, call: relax.Call, cpu_block: int) -> relax.Expr:
    data, weight, params, epilogue = _split_args(call)
    args = [data, weight, *params, relax.prim_value(cpu_block), *epilogue]
    return relax.call_dps_packed(ROW_CONV2D_FUNC, args, call.ty_args[0])


def _im2col_unavailable(shape: ConvShape, cpu_block: int) -> str | None:
    """A depthwise conv is no generic call (the pass leaves it to TIR or the depthwise kernel)."""
    if shape.block:
        return "NCHW data only"
    depthwise = shape.groups > 1 and shape.in_c == 1
    return "depthwise: no generic library call (TIR or the depthwise kernel)" if depthwise else None


def _emit_im2col(bb: relax.BlockBuilder, call: relax.Call, cpu_block: int) -> relax.Expr:
    return relax.call_dps_packed(IM2COL_CONV2D_FUNC, list(call.args[1].fields), call.ty_args[0])


CONV_ALGORITHMS: dict[str, ConvAlgorithm] = {a.name: a for a in [
    _winograd(4),
    _winograd(2),
    _direct(16),
    _direct(8),
    ConvAlgorithm("rows", ROW_CONV2D_FUNC, _nchw_kernel,
                  lambda shape, cpu_block, _: row_conv_for(shape.in_c, shape.kernel, cpu_block), _emit_rows),
    # The generic call runs im2col + OpenBLAS itself, so the default rule never needs to pick it;
    # chosen (kernel selection), it becomes its own name, which the default rule leaves alone.
    ConvAlgorithm("im2col", IM2COL_CONV2D_FUNC, _im2col_unavailable, lambda shape, cpu_block, _: False, _emit_im2col),
]}
"""The CPU library's conv2d algorithms, in the default rule's order of preference. Kernel
selection offers each as a candidate (`library:conv_<name>`) for the shapes it can run: NCHW
convs, and groups-1 convs on NCHW{B}c data and output with a choice (`has_choice`)."""


def default_conv_algorithm(shape: ConvShape, cpu_block: int, winograd: int | None) -> ConvAlgorithm | None:
    """The algorithm an untuned build runs a conv2d on: the first of `CONV_ALGORITHMS` that can
    run it and whose rule wants it; None where none does (the generic call, im2col + OpenBLAS;
    on blocked data the direct kernel always can, with its block on this CPU).
    `winograd`: `$GIMLET_CPU_WINOGRAD`'s tile (`winograd_override`), None for the rule."""
    return next((a for a in CONV_ALGORITHMS.values()
                 if a.unavailable(shape, cpu_block) is None and a.wanted(shape, cpu_block, winograd)), None)


def has_choice(shape: ConvShape, cpu_block: int) -> bool:
    """Whether more than one of `CONV_ALGORITHMS` can run the shape (on blocked data: where a
    Winograd kernel can, beside the direct one)."""
    return sum(a.unavailable(shape, cpu_block) is None for a in CONV_ALGORITHMS.values()) > 1


def depthwise_kernel_wanted() -> bool | None:
    """`$GIMLET_CPU_DEPTHWISE`: "1" puts every depthwise conv on the depthwise kernel, "0" none;
    unset, None: `depthwise_conv_for`'s rule decides."""
    value = os.environ.get(DEPTHWISE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise CompileError(f"${DEPTHWISE_ENV} must be 0 or 1, not {value!r}")
    return None if value == "" else value == "1"


# The narrowest input the depthwise kernel takes by default (see `depthwise_conv_for`).
DEPTHWISE_MIN_WIDTH = 112


def depthwise_conv_for(in_c: int, groups: int, width: int, cpu_block: int, wanted: bool | None) -> bool:
    """Whether a conv2d with one input channel per group and input `width` runs on the
    depthwise kernel (`gimlet.cpu.conv2d_nchw_depthwise`): one group per input channel (each
    output channel reads one input channel; any channel multiplier), on a CPU with a direct
    kernel (`cpu_block` not 0; the call asks for vectors of `cpu_block` lanes, as the row
    kernel's does), where `wanted` (`$GIMLET_CPU_DEPTHWISE`) says so, or by default for inputs
    at least `DEPTHWISE_MIN_WIDTH` wide. benchmarks/conv_direct.py --depthwise
    (benchmarks/README.md, "A depthwise kernel"; 1 thread, a shared 2-core AMD EPYC):
    against the generated TIR it tied or won only on MobileNetV2's 112-pixel layers (0.85-1.00
    of the time over five runs); on smaller planes (56 to 7 pixels, mobilenet_cnn's 32 to 8)
    it took 1.1-1.8x as long (its per-unit copy into phase rows and setup outweigh 9
    multiply-adds per output), so those stay in TIR, where FuseOps fuses their epilogues."""
    if cpu_block == 0 or groups != in_c:
        return False
    return width >= DEPTHWISE_MIN_WIDTH if wanted is None else wanted


def transposed_constant(matrix: relax.Constant) -> relax.Constant:
    """A 2-D constant transposed, at build time: the one-row matmul's weight ([K, N] to the
    library's [N, K]), and back for kernel selection's op group."""
    return relax.const(np.ascontiguousarray(matrix.value.numpy().T))


def library_matmul(call: relax.Expr) -> tuple[relax.Expr, relax.Expr, bool, list] | None:
    """`(a, b, transpose_b, epilogue)` of a `gimlet.cpu.matmul` call this pass wrote, None for
    any other expression. `epilogue`: its steps in order, `("add", addend, divisor)` (an
    addend broadcast along the output, one element per `divisor` consecutive outputs for a
    vector, divisor 1 for an output-shaped tensor), `("relu",)` or `("gelu",)`. A call with a
    clip step gives None too: kernel selection, which reads these, has no clip step yet."""
    if not _calls(call, MATMUL_FUNC):
        return None
    a, b, transpose, *epilogue = call.args[1].fields
    steps = _epilogue_steps(epilogue)
    return None if _has_clip(steps) else (a, b, bool(int(transpose.value)), steps)


def library_conv2d(call: relax.Expr, func: str = CONV2D_FUNC
                   ) -> tuple[relax.Expr, relax.Expr, list[int], list] | None:
    """`(data, weight, params, epilogue)` of a generic conv call this pass wrote, `func`:
    `gimlet.cpu.conv2d_nchw` (with `grouping`, every NCHW conv2d it takes is one) or
    `.conv2d_nchwc` (`BLOCKED_CONV2D_FUNC`); None for any other expression. `params`: strides
    (h, w), top and left padding, dilations (h, w) and groups; `epilogue` as `library_matmul`'s
    (None with a clip step, too)."""
    if not _calls(call, func):
        return None
    data, weight, *args = call.args[1].fields
    params = [int(p.value) for p in args[:7]]
    steps = _epilogue_steps(args[7:])
    return None if _has_clip(steps) else (data, weight, params, steps)


def _has_clip(steps: list) -> bool:
    return any(step[0] == "clip" for step in steps)


def _calls(call: relax.Expr, func: str) -> bool:
    """`call` is a `call_dps_packed` of the packed function `func`."""
    return (isinstance(call, relax.Call) and call.op == tvm.ir.Op.get("relax.call_dps_packed")
            and call.args[0].global_symbol == func)


def _clip_bounds(lo: float, hi: float) -> relax.Constant:
    """A clip step's bounds, as the library takes them from the dispatch: a float32 constant
    [lo, hi]. (As two float scalars, the VM computed each in a call of its own before every
    call with a clip: 70 calls a run in MobileNetV2.)"""
    return relax.const(np.array([lo, hi], np.float32))


def _epilogue_steps(args: list[relax.Expr]) -> list:
    """A library call's epilogue arguments as steps (see `library_matmul`; a clip step is
    `("clip", lo, hi)`, a blocked output's per-channel vector `("add_blocked", vector, divisor,
    block)`)."""
    names = {code: name for name, code in ACTIVATIONS.items()} | {HARD_SWISH: "relax.hard_swish"}
    steps, index = [], 0
    while index < len(args):
        kind = int(args[index].value)
        if kind == ADD_VECTOR:
            steps.append(("add", args[index + 1], int(args[index + 2].value)))
            index += 3
        elif kind == ADD_TENSOR:
            steps.append(("add", args[index + 1], 1))
            index += 2
        elif kind == ADD_BLOCKED_VECTOR:
            steps.append(("add_blocked", args[index + 1], int(args[index + 2].value), int(args[index + 3].value)))
            index += 4
        elif kind == CLIP:
            lo, hi = args[index + 1].value.numpy()
            steps.append(("clip", float(lo), float(hi)))
            index += 2
        else:
            steps.append((names[kind].rsplit(".", 1)[1],))
            index += 1
    return steps


def library_attention(call: relax.Expr) -> tuple[list[relax.Expr], float] | None:
    """`([query, key, value(, bias)], scale)` of a `gimlet.cpu.attention` call this pass
    wrote, None for any other expression."""
    if not _calls(call, ATTENTION_FUNC):
        return None
    *operands, scale = call.args[1].fields
    return operands, float(scale.value)


def hard_sigmoid_input(gate: relax.Expr, binding_of: Callable[[relax.Expr], relax.Expr | None]) -> relax.Expr | None:
    """The x of which `gate` computes hard_sigmoid(x) = clip(x / 6 + 1 / 2, 0, 1), else None.

    The gate must be a chain of ops by float32 scalar constants (add, subtract, multiply,
    divide) with one clip (`R.clip`, or `R.maximum` / `R.minimum` by a constant) among them,
    each link found through `binding_of`: the ONNX importer's HardSwish (clip(x + 3, 0, 6) / 6)
    and HardSigmoid with alpha 1/6, beta 1/2 (clip(x / 6 + 1/2, 0, 1)) alike. The chain is
    pre(x) = a1 x + b1, clipped to [lo, hi], then post(y) = a2 y + b2; it is hard-sigmoid when
    pre's breakpoints lo and hi fall at x = -3 and 3 and post maps lo to 0 and hi to 1."""
    links: list[tuple[str, float, float]] = []  # outermost first: ("affine", a, b) or ("clip", lo, hi)
    expr = gate
    while len(links) < 8:
        call = binding_of(expr)
        if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op):
            break
        link = _chain_link(call)
        if link is None:
            break
        links.append(link[0])
        expr = link[1]
    pre, bounds, post = (1.0, 0.0), None, (1.0, 0.0)
    for kind, first, second in reversed(links):
        if kind == "clip":
            if post != (1.0, 0.0):
                return None  # a second clip after an affine step: not one clip
            lo, hi = bounds or (-math.inf, math.inf)
            bounds = (max(lo, first), min(hi, second))
        elif bounds is None:
            pre = (first * pre[0], first * pre[1] + second)
        else:
            post = (first * post[0], first * post[1] + second)
    if bounds is None or pre[0] <= 0 or not all(map(math.isfinite, bounds)):
        return None
    (a1, b1), (lo, hi), (a2, b2) = pre, bounds, post
    expected = ((lo - b1) / a1, -3.0), ((hi - b1) / a1, 3.0), (a2 * lo + b2, 0.0), (a2 * hi + b2, 1.0)
    return expr if all(math.isclose(got, want, abs_tol=1e-6) for got, want in expected) else None


def _chain_link(call: relax.Call) -> tuple[tuple[str, float, float], relax.Expr] | None:
    """One op of a hard-sigmoid chain: (("affine", a, b): a x + b, or ("clip", lo, hi)), and
    its operand x; None for anything else."""
    name = call.op.name
    if name == "relax.clip":
        lo, hi = (float(arg.value) if isinstance(arg, (tvm.tirx.IntImm, tvm.tirx.FloatImm)) else None
                  for arg in call.args[1:3])
        return None if lo is None or hi is None else (("clip", lo, hi), call.args[0])
    if name not in _SCALAR_OPS:
        return None
    for operand, constant, constant_first in ((call.args[0], call.args[1], False), (call.args[1], call.args[0], True)):
        c = _scalar_constant(constant)
        if c is None:
            continue
        if name == "relax.maximum":
            return ("clip", c, math.inf), operand
        if name == "relax.minimum":
            return ("clip", -math.inf, c), operand
        if name == "relax.add":
            return ("affine", 1.0, c), operand
        if name == "relax.multiply":
            return ("affine", c, 0.0), operand
        if name == "relax.subtract":
            return (("affine", -1.0, c) if constant_first else ("affine", 1.0, -c)), operand
        if name == "relax.divide" and not constant_first and c != 0:
            return ("affine", 1.0 / c, 0.0), operand
        return None
    return None


def variable_uses(func: relax.Function) -> collections.Counter:
    """How often each variable is used in `func`."""
    counts: collections.Counter = collections.Counter()
    relax.analysis.post_order_visit(
        func.body, lambda e: counts.update([e]) if isinstance(e, relax.Var) else None
    )
    return counts


def _on_host(ty: relax.Type) -> bool:
    """The tensor has no virtual device, or one whose target has the CPU library."""
    vdevice = getattr(ty, "vdevice", None)
    return vdevice is None or CPU_LIBRARY in spec_for(vdevice.target).libraries


def _is_float32_tensor(ty: relax.Type, min_ndim: int) -> bool:
    return (
        isinstance(ty, relax.TensorType)
        and ty.dtype == "float32"
        and ty.ndim >= min_ndim
        and ty.shape is not None
        and _on_host(ty)
    )


def _scalar_constant(expr: relax.Expr) -> float | None:
    """The value of a float32 constant of one element that is not NaN, else None."""
    if not isinstance(expr, tvm.ir.GenericConst) or expr.ty.dtype != "float32":
        return None
    value = expr.value.numpy()
    if value.size != 1 or np.isnan(value).any():
        return None
    return float(value.reshape(()))


def _one_row(a: relax.Expr) -> bool:
    """Whether matmul operand `a` is statically one row (every axis but the last 1)."""
    rows = _static_ints(list(a.ty.shape)[:-1])
    return rows is not None and all(r == 1 for r in rows)


def _static_ints(values) -> list[int] | None:
    """The values as Python ints, or None when one of them is symbolic."""
    if not all(isinstance(v, (int, tvm.tirx.IntImm)) for v in values):
        return None
    return [int(v) for v in values]


@mutator
class _LibraryCallRewriter(PyExprMutator):  # pylint: disable=abstract-method
    use_counts: collections.Counter = collections.Counter()
    fuse_epilogues = True
    conv_kernels = True  # groups-1 convs on the Winograd, direct and row kernels where they win
    direct_block = 0  # this CPU's channel block for the direct conv2d kernel; 0: not used
    winograd: int | None = None  # `$GIMLET_CPU_WINOGRAD`'s Winograd tile (0: none); None: the rule
    depthwise_wanted: bool | None = None  # `$GIMLET_CPU_DEPTHWISE`; None: the default rule

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op):
            return call
        rewritten = None
        if self.conv_kernels and _calls(call, CONV2D_FUNC):  # a group kernel selection left to the library
            rewritten = conv_kernel(self.builder_, call, self.direct_block, self.winograd)
        elif call.op.name == "relax.matmul":
            rewritten = self._rewrite_matmul(call)
        elif call.op.name == "relax.nn.conv2d":
            rewritten = self._rewrite_conv2d(call)
        elif call.op.name in ("relax.nn.attention", "relax.nn.attention_bias"):
            rewritten = self._rewrite_attention(call)
        elif call.op.name == "relax.nn.max_pool2d":
            rewritten = self._rewrite_blocked_max_pool(call)
        elif call.op.name in ACTIVATIONS:
            rewritten = self._with_epilogue(call.args[0], [relax.prim_value(ACTIVATIONS[call.op.name])])
        elif call.op.name == "relax.add":
            rewritten = self._with_added(*call.args)
            if rewritten is None:
                rewritten = self._with_added(*call.args[::-1])
        elif call.op.name == "relax.multiply":
            rewritten = self._with_hard_swish(*call.args)
            if rewritten is None:
                rewritten = self._with_hard_swish(*call.args[::-1])
        elif call.op.name in ("relax.maximum", "relax.minimum"):
            rewritten = self._with_clipped(call.op.name == "relax.maximum", *call.args)
            if rewritten is None:
                rewritten = self._with_clipped(call.op.name == "relax.maximum", *call.args[::-1])
        return call if rewritten is None else rewritten

    def _with_epilogue(self, result: relax.Expr, steps: list[relax.Expr], uses: int = 1) -> relax.Expr | None:
        """The matmul / conv2d library call `result` is bound to, with `steps` appended to its
        epilogue, when `result` has no other use than the `uses` the steps replace."""
        if not self.fuse_epilogues or not isinstance(result, relax.Var) or self.use_counts[result] != uses:
            return None
        bound = self.lookup_binding(result)
        if not (
            isinstance(bound, relax.Call)
            and bound.op == tvm.ir.Op.get("relax.call_dps_packed")
            and bound.args[0].global_symbol in _EPILOGUE_START
        ):
            return None
        func = bound.args[0].global_symbol
        return relax.call_dps_packed(func, [*bound.args[1].fields, *steps], bound.ty)

    def _with_clipped(self, lower: bool, result: relax.Expr, bound: relax.Expr) -> relax.Expr | None:
        """`maximum(result, bound)` (`lower`) or `minimum(result, bound)` as a clip step of the
        library call `result` is bound to, for a float32 scalar constant `bound` that is not
        NaN; an upper bound right after a step with only a lower one tightens that step."""
        value = _scalar_constant(bound)
        if value is None or not _is_float32_tensor(result.ty, 1):
            return None
        lo, hi = (value, math.inf) if lower else (-math.inf, value)
        fused = self._with_epilogue(result, [relax.prim_value(CLIP), _clip_bounds(lo, hi)])
        if fused is None or lower:
            return fused
        func, args = fused.args[0], list(fused.args[1].fields)
        steps = _epilogue_steps(args[_EPILOGUE_START[func.global_symbol]:-2])
        if steps and steps[-1][0] == "clip" and steps[-1][2] == math.inf:
            args = args[:-2]  # without the new step; the previous one gets its upper bound
            args[-1] = _clip_bounds(steps[-1][1], hi)
            return relax.call_dps_packed(func, args, result.ty)
        return fused

    def _with_hard_swish(self, result: relax.Expr, gate: relax.Expr) -> relax.Expr | None:
        """`result * gate` as a hard-swish step of the library call `result` is bound to, where
        `gate` is hard_sigmoid(result) (`hard_sigmoid_input`) through bindings used once: the
        call's result is read by the gate and the product only, which the step replaces."""
        source = hard_sigmoid_input(gate, self._single_use_binding)
        if source is None or not source.same_as(result) or not _is_float32_tensor(result.ty, 1):
            return None
        return self._with_epilogue(result, [relax.prim_value(HARD_SWISH)], uses=2)

    def _single_use_binding(self, var: relax.Expr) -> relax.Expr | None:
        """The value bound to `var` where it is used once, else None."""
        return self.lookup_binding(var) if isinstance(var, relax.Var) and self.use_counts[var] == 1 else None

    def _with_added(self, result: relax.Expr, addend: relax.Expr) -> relax.Expr | None:
        """`result + addend` as an epilogue step of the library call `result` is bound to."""
        out_ty, ty = result.ty, addend.ty
        if not (_is_float32_tensor(out_ty, 1) and _is_float32_tensor(ty, 0)):
            return None
        analyzer = tvm.sym.Analyzer()
        out_shape, shape = list(out_ty.shape), list(ty.shape)
        if len(shape) > len(out_shape):
            return None
        if len(shape) == len(out_shape) and all(
            analyzer.can_prove_equal(a, b) for a, b in zip(shape, out_shape)
        ):
            return self._with_epilogue(result, [relax.prim_value(ADD_TENSOR), addend])
        # A vector along one axis (aligned from the right); all other extents 1.
        offset = len(out_shape) - len(shape)
        axes = [i for i, d in enumerate(shape) if not (isinstance(d, tvm.tirx.IntImm) and int(d) == 1)]
        if len(shape) == len(out_shape) == 5 and axes in ([1, 4], [4]):
            return self._with_blocked_vector(result, addend, out_shape, shape)
        if len(axes) > 1:
            return None
        axis = offset + axes[0] if axes else len(out_shape) - 1
        if axes and not analyzer.can_prove_equal(shape[axes[0]], out_shape[axis]):
            return None
        divisor = _static_ints(out_shape[axis + 1 :])
        if divisor is None:
            return None
        step = [relax.prim_value(ADD_VECTOR), addend, relax.prim_value(math.prod(divisor))]
        return self._with_epilogue(result, step)

    def _with_blocked_vector(self, result: relax.Expr, addend: relax.Expr, out_shape: list,
                             shape: list) -> relax.Expr | None:
        """`result + addend` for a 5-D output [N, C / B, H, W, B] (channel-blocked) and a
        per-channel vector [1, C / B, 1, 1, B] (or [1, 1, 1, 1, B]) as a blocked-vector
        epilogue step, which the blocked kernels apply on vectors."""
        analyzer = tvm.sym.Analyzer()
        dims = _static_ints(out_shape[2:])
        if dims is None or not all(analyzer.can_prove_equal(shape[i], out_shape[i]) for i in (1, 4)):
            return None
        step = [relax.prim_value(ADD_BLOCKED_VECTOR), addend, relax.prim_value(math.prod(dims)),
                relax.prim_value(dims[2])]
        return self._with_epilogue(result, step)

    def _rewrite_attention(self, call: relax.Call) -> relax.Expr | None:
        query, key, value = call.args[:3]
        attrs = call.attrs
        if attrs.causal_mask is not None or attrs.window_size is not None:
            return None
        if not all(_is_float32_tensor(t.ty, 4) and t.ty.ndim == 4 for t in [*call.args, call]):
            return None
        scale = None if attrs.scale is None else attrs.scale.value
        if scale is None:
            depth = _static_ints([query.ty.shape[3]])
            if depth is None:
                return None
            scale = 1.0 / math.sqrt(depth[0])
        args = [query, key, value, *call.args[3:], relax.prim_value(float(scale))]
        return relax.call_dps_packed(ATTENTION_FUNC, args, call.ty)

    def _rewrite_blocked_max_pool(self, call: relax.Call) -> relax.Expr | None:
        """A max pool on float32 NCHW{B}c data (B 8 or 16; what `blocked_layout` writes) with
        static attributes, into the library's blocked max pool; its output extents (ceil mode
        included) are the call's."""
        data, attrs = call.args[0], call.attrs
        block = _static_ints([data.ty.shape[4]]) if _is_float32_tensor(data.ty, 5) and data.ty.ndim == 5 else None
        params = _static_ints([*attrs.strides, *attrs.padding[:2], *attrs.dilation, *attrs.pool_size])
        if (block not in ([8], [16]) or params is None or attrs.layout != f"NCHW{block[0]}c"
                or attrs.out_layout != attrs.layout):
            return None
        return relax.call_dps_packed(BLOCKED_MAX_POOL_FUNC, [data, *(relax.prim_value(p) for p in params)], call.ty)

    def _transposed_operand(self, expr: relax.Expr) -> relax.Expr | None:
        """`w` when `expr` is bound to `permute_dims(w)` swapping exactly the last two axes."""
        if not isinstance(expr, relax.Var):
            return None
        value = self.lookup_binding(expr)
        if not (
            isinstance(value, relax.Call)
            and isinstance(value.op, tvm.ir.Op)
            and value.op.name == "relax.permute_dims"
        ):
            return None
        ndim = value.args[0].ty.ndim
        if ndim < 2:
            return None
        swap_last = list(range(ndim))
        swap_last[-1], swap_last[-2] = swap_last[-2], swap_last[-1]
        axes = value.attrs.axes
        if axes is None and ndim != 2:
            return None
        if axes is not None and [int(a) for a in axes] != swap_last:
            return None
        return value.args[0]

    def _rewrite_matmul(self, call: relax.Call) -> relax.Expr | None:
        a, b = call.args
        if not (
            _is_float32_tensor(a.ty, 2)
            and _is_float32_tensor(b.ty, 2)
            and _is_float32_tensor(call.ty, 2)
        ):
            return None
        weight = self._transposed_operand(b)
        if weight is None and isinstance(b, tvm.ir.GenericConst) and b.ty.ndim == 2 and _one_row(a):
            weight = transposed_constant(b)
        args = [a, b, relax.prim_value(0)] if weight is None else [a, weight, relax.prim_value(1)]
        return relax.call_dps_packed(MATMUL_FUNC, args, call.ty)

    def _rewrite_conv2d(self, call: relax.Call) -> relax.Expr | None:
        data, weight = call.args
        attrs = call.attrs
        if attrs.out_layout != "NCHW" or attrs.data_layout != "NCHW":
            return self._rewrite_blocked_conv2d(call)
        if not (
            _is_float32_tensor(data.ty, 4)
            and _is_float32_tensor(weight.ty, 4)
            and _is_float32_tensor(call.ty, 4)
            and attrs.data_layout == "NCHW"
            and attrs.kernel_layout == "OIHW"
            and attrs.out_layout == "NCHW"
        ):
            return None
        groups = int(attrs.groups)
        channels_per_group = _static_ints([weight.ty.shape[1]])
        params = _static_ints([*attrs.strides, *attrs.padding[:2], *attrs.dilation])
        if groups > 1 and channels_per_group == [1]:  # depthwise
            channels_width = _static_ints([data.ty.shape[1], data.ty.shape[3]])
            if not (self.conv_kernels and params is not None and channels_width is not None
                    and depthwise_conv_for(channels_width[0], groups, channels_width[1],
                                           self.direct_block, self.depthwise_wanted)):
                return None
            args = [data, weight, *(relax.prim_value(p) for p in params), relax.prim_value(self.direct_block)]
            return relax.call_dps_packed(DEPTHWISE_CONV2D_FUNC, args, call.ty)
        if params is None:
            return None
        args = [data, weight, *(relax.prim_value(p) for p in params), relax.prim_value(groups)]
        generic = relax.call_dps_packed(CONV2D_FUNC, args, call.ty)
        return conv_kernel(self.builder_, generic, self.direct_block, self.winograd) if self.conv_kernels else generic

    def _rewrite_blocked_conv2d(self, call: relax.Call) -> relax.Expr | None:
        """A conv2d with an OIHW weight and NCHW{B}c data or output (what `blocked_layout`
        writes): both blocked, groups 1, depthwise or groups of whole blocks; NCHW data (an
        entry conv) or an NCHW output (an exit conv), groups 1. On the direct or blocked
        depthwise kernel, its weight packed into blocks of B output channels; both blocked and
        groups 1 with a choice of algorithms (`has_choice`: Winograd too), the generic call
        `BLOCKED_CONV2D_FUNC` (an op group for kernel selection) and, but in the grouping run,
        the algorithm the default rule picks for it; a conv on data gated per channel runs the
        scaled direct kernel (`_channel_scaled`) before any choice."""
        data, weight = call.args
        attrs = call.attrs
        blocked_out, blocked_data = _is_float32_tensor(call.ty, 5), _is_float32_tensor(data.ty, 5)
        block = _static_ints([(call if blocked_out else data).ty.shape[4]]) if blocked_out or blocked_data else None
        params = _static_ints([*attrs.strides, *attrs.padding[:2], *attrs.dilation])
        if block is None or params is None or attrs.kernel_layout != "OIHW" or not _is_float32_tensor(weight.ty, 4):
            return None
        block = block[0]
        groups, func = int(attrs.groups), DIRECT_CONV2D_FUNC
        layouts = {True: f"NCHW{block}c", False: "NCHW"}
        if (attrs.data_layout != layouts[blocked_data] or attrs.out_layout != layouts[blocked_out]
                or not _is_float32_tensor(data.ty, 4) or not _is_float32_tensor(call.ty, 4)
                or (blocked_data and _static_ints([data.ty.shape[4]]) != [block])
                or (groups != 1 and not (blocked_data and blocked_out))):
            return None
        if groups > 1 and _static_ints([weight.ty.shape[1]]) == [1]:
            func = BLOCKED_DEPTHWISE_CONV2D_FUNC
        elif groups > 1:  # groups of whole blocks: the direct kernel runs each group as an image
            out_and_group_in = _static_ints(list(weight.ty.shape)[:2])
            if out_and_group_in is None or out_and_group_in[1] % block or out_and_group_in[0] % (groups * block):
                return None
        args = [relax.prim_value(p) for p in params]
        gated = self._channel_scaled(data, weight) if func == DIRECT_CONV2D_FUNC and groups == 1 else None
        if gated is None and blocked_data and blocked_out and groups == 1:
            generic = relax.call_dps_packed(BLOCKED_CONV2D_FUNC, [data, weight, *args, relax.prim_value(1)], call.ty)
            shape = conv_shape(generic)
            # As with a constant weight: kernel selection's checks pass it as a parameter.
            if shape is not None and has_choice(dataclasses.replace(shape, constant_weight=True), self.direct_block):
                return generic  # onto a kernel after the dispatch (`_BlockedConvKernels`)
        packed = packed_conv_weight(self.builder_, weight, block)
        if gated is not None:
            return relax.call_dps_packed(SCALED_DIRECT_CONV2D_FUNC, [*gated, packed, *args], call.ty)
        return relax.call_dps_packed(func, [data, packed, *args], call.ty)

    def _channel_scaled(self, data: relax.Expr, weight: relax.Expr) -> tuple[relax.Expr, relax.Expr] | None:
        """(x, scale) where the conv's blocked `data` [N, C / B, H, W, B] is bound to `x * scale`
        and read by the conv only, `scale` [1, C / B, 1, 1, B] (one factor per channel for
        every image: a squeeze-and-excitation gate), and the weight has at most a quarter as
        many elements per input channel as the data (4 * O * KH * KW <= N * H * W): the kernel
        scales the weight on one thread, from memory, where the product ran on every thread
        over data still in cache (a 14x14 projection 672 -> 112 took 25-35 us longer scaled,
        the product took 10). EfficientNet-B0 ran in 0.97 of its time, MobileNetV3 in 0.98."""
        bound = self._single_use_binding(data) if self.fuse_epilogues else None
        if not (isinstance(bound, relax.Call) and bound.op == tvm.ir.Op.get("relax.multiply")):
            return None
        data_shape = _static_ints(data.ty.shape) if data.ty.ndim == 5 else None  # (not an entry conv's)
        weight_shape = _static_ints(weight.ty.shape)
        if data_shape is None or weight_shape is None:
            return None
        batch, blocks, height, width, block = data_shape
        if weight_shape[0] * weight_shape[2] * weight_shape[3] * 4 > batch * height * width:
            return None
        for x, scale in (bound.args, bound.args[::-1]):
            if (_is_float32_tensor(x.ty, 5) and _static_ints(x.ty.shape) == data_shape
                    and _is_float32_tensor(scale.ty, 5) and _static_ints(scale.ty.shape) == [1, blocks, 1, 1, block]):
                return x, scale
        return None


def conv_kernel(bb: relax.BlockBuilder, call: relax.Call, cpu_block: int, winograd: int | None) -> relax.Expr:
    """A generic conv call (with its epilogue) on the algorithm the default rule picks for its
    shape (`default_conv_algorithm`), else as it is (`gimlet.cpu.conv2d_nchw`: im2col +
    OpenBLAS; a blocked one always has the direct kernel)."""
    shape = conv_shape(call)
    algorithm = None if shape is None else default_conv_algorithm(shape, cpu_block, winograd)
    return call if algorithm is None else algorithm.emit(bb, call, cpu_block)


def channel_concat_parts(concat: relax.Expr, binding_of: Callable[[relax.Var], relax.Expr | None],
                         use_counts: collections.Counter) -> list[relax.Expr] | None:
    """The values a concat along axis 1 of one image's float32 NCHW{B}c values (batch statically
    1: each channel block whole and in order) joins, each bound to a variable the concat alone
    reads (`binding_of`); None for any other expression. `ConcatInPlace` has such a concat of
    direct convs written by the convs in place."""
    if not (isinstance(concat, relax.Call) and isinstance(concat.op, tvm.ir.Op) and concat.op.name == "relax.concat"):
        return None
    ty = concat.ty
    if (concat.attrs.axis is None or int(concat.attrs.axis) % 5 != 1 or not isinstance(ty, relax.TensorType)
            or ty.ndim != 5 or ty.dtype != "float32" or ty.shape is None):
        return None
    if not (isinstance(ty.shape[0], tvm.tirx.IntImm) and int(ty.shape[0]) == 1):
        return None
    parts = concat.args[0]
    if isinstance(parts, relax.Var):
        parts = binding_of(parts)
    if not isinstance(parts, relax.Tuple):
        return None
    values = [binding_of(part) if isinstance(part, relax.Var) and use_counts[part] == 1 else None
              for part in parts.fields]
    return None if any(value is None for value in values) else values


def in_place_concat_convs(func: relax.Function) -> set[relax.Call]:
    """The generic blocked conv calls of `func` that are parts of a channel concat whose every
    part is such a call or a direct conv (`channel_concat_parts`): on the direct kernel the
    concat is written in place (`ConcatInPlace`), on another it is a copy, which an op group's
    timing does not see (SqueezeNet's fire modules: 1.09x its time with Winograd chosen)."""
    bindings = {b.var: b.value for block in func.body.blocks for b in block.bindings
                if isinstance(b, relax.VarBinding)}
    use_counts = variable_uses(func)
    found: set[relax.Call] = set()
    for value in bindings.values():
        parts = channel_concat_parts(value, bindings.get, use_counts)
        if parts is not None and all(_calls(p, BLOCKED_CONV2D_FUNC) or _calls(p, DIRECT_CONV2D_FUNC) for p in parts):
            found.update(p for p in parts if _calls(p, BLOCKED_CONV2D_FUNC))
    return found


@mutator
class _BlockedConvKernels(PyExprMutator):  # pylint: disable=abstract-method
    """After the dispatch: generic blocked conv calls (`BLOCKED_CONV2D_FUNC`, epilogues fused)
    onto kernels. Those in `in_place` (`in_place_concat_convs`) onto the direct one; unless
    `choose` is False (the grouping run: op groups), the others onto the default rule's pick."""

    choose = True
    direct_block = 0
    winograd: int | None = None
    in_place: set = set()

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        in_place = call in self.in_place
        call = super().visit_call_(call)
        if not _calls(call, BLOCKED_CONV2D_FUNC):
            return call
        if in_place:
            direct = CONV_ALGORITHMS[f"direct{int(call.args[1].fields[0].ty.shape[4])}"]
            return direct.emit(self.builder_, call, self.direct_block)
        return conv_kernel(self.builder_, call, self.direct_block, self.winograd) if self.choose else call
