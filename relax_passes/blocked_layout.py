"""Run regions of a CNN on channel-blocked data (NCHW{B}c: [N, C / B, H, W, B]), as
onnxruntime's MLAS does, converting layouts only where a region meets an op it does not
cover.

1. Where it goes: after the imported graph's clean-up and graph fusion
   (`library_dispatch.layout_passes`), before kernel selection's rewrites and the CPU
   library's dispatch (`library_dispatch.library_passes`), which maps the blocked convs to
   `gimlet.cpu.conv2d_nchw_direct` (blocked data and output) and
   `gimlet.cpu.conv2d_nchwc_depthwise` and fuses the blocked epilogues into them; only for
   this machine's CPU (a cross-compiled CPU's vector width is not known here). Kernel
   selection sees the module after it too, so a blocked conv is no op group: it keeps its
   blocked kernel whatever a selection chose, and only the convs left in NCHW get a
   selection's conv algorithm.
2. B is the CPU's vector width (`dispatch_cpu_library.direct_conv_block`: 16 with AVX-512, 8
   with AVX2). By default it converts every function with a conv it can convert
   (`blocked_layout_for`: whole networks were measured faster or even); `$GIMLET_CPU_BLOCKED_LAYOUT`
   (8 or 16) converts every function with that block, 0 none. In dataflow order, it rewrites
   into blocked form
   - `R.nn.conv2d` (NCHW data and output, OIHW float32 weight, static shapes) that is groups 1,
     depthwise (one group per channel, channel multiplier 1) or grouped with groups of whole
     blocks (`_whole_block_groups`), as `R.nn.conv2d(data_layout=
     "NCHW{B}c", kernel_layout="OIHW", out_layout="NCHW{B}c")` (the CPU library runs it on the
     direct, blocked depthwise or, where `winograd_tile_for` says so, Winograd kernel). A
     channel count off the block is padded with zero channels up to ceil(C / B) blocks where
     that adds at most `MAX_PADDING` of the work (`padded_channels`: MobileNetV3's 72 as 80,
     not 24 as 32), for a constant weight, which gets zero output channels (a padded channel
     computes 0) and zero input channels for padded data (whatever a padded channel of the data
     holds adds nothing). A groups-1 conv with input channels off the block on NCHW data (an
     entry conv: a network's 3-channel stem) keeps `data_layout="NCHW"`; a groups-1 conv on
     blocked data whose output channels are off the block and not padded (an exit conv:
     MobileNetV2's 24-channel projections) keeps `out_layout="NCHW"`. Entry and exit convs
     that the library would run with Winograd (which takes both layouts alike) stay NCHW;
   - ops that do not care about the layout, once an operand is blocked: unary elementwise ops
     (`ELEMENTWISE_UNARY`), binary ones (`ELEMENTWISE_BINARY`) whose other operand is blocked
     too, a scalar, or a per-channel vector ([1 or N, C, 1, 1]: a constant reblocked here with
     numpy, a tensor reshaped), where a blocked operand broadcasts over batch or spatial axes
     only (a squeeze-and-excitation block's gate, [N, C, 1, 1], times its input), and max /
     average pooling (`layout="NCHW{B}c"`). The batch extent may be symbolic; the others
     must be static. Padding channels stay finite: vectors are padded with 0, a divisor's
     with 1, and a blocked divisor with padding is not taken (0 / 0);
   - a concat along the channels of tensors whose channel counts are multiples of B (no
     padding), one of them blocked (SqueezeNet's fire modules, DenseNet's dense blocks), as a
     concat of the blocked values along the channel blocks;
   - a mean over the spatial axes of a blocked value (global average pooling), taken on the
     blocked data (the CPU library's `gimlet.cpu.nchwc_spatial_mean`) and reshaped to the NCHW
     result: with one pixel left, [N, C / B, 1, 1, B] is NCHW's order, so the region ends
     without converting the whole tensor back (as onnxruntime's NCHWc global pooling; each
     window step adds a vector of B channels).
   An op it does not rewrite that reads a blocked value gets a conversion back to NCHW (once per
   value), and so does a dataflow block's output; a blocked conv or binary op that reads an
   NCHW tensor gets one into NCHW{B}c (once per tensor). Conversions are the CPU library's
   `gimlet.cpu.nchw_to_nchwc` / `nchwc_to_nchw` calls (TVM's generated `R.layout_transform`
   kernels took several times as long; they zero the padding channels and drop them), or
   reshapes for tensors of one pixel (the same order; a pad or a slice for padding). So
   conversions of activations sit only at the regions' edges (the network's input side,
   global pooling / flatten, outputs), never around each op.
3. It does not handle: convs with output channel counts off the block that padding would
   make too costly, or with a weight that is no constant (they stay NCHW, and so do the ops
   between them), grouped convs other than depthwise whose groups split a block, depthwise
   convs with a channel multiplier, other dtypes, symbolic channel or spatial extents, binary
   ops that broadcast a blocked operand along its channels.
   It does not weigh a region's edge conversions against what its kernels save:
   `blocked_layout_for` decides per function.
"""

from __future__ import annotations

import os

import numpy as np
import tvm
from tvm import IRModule, relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..errors import CompileError
from ..targets.libraries import CPU_LIBRARY
from .dispatch_cpu_library import direct_conv_block, winograd_override, winograd_tile_for

BLOCKED_LAYOUT_ENV = "GIMLET_CPU_BLOCKED_LAYOUT"
TO_BLOCKED_FUNC = f"{CPU_LIBRARY.name}.nchw_to_nchwc"
FROM_BLOCKED_FUNC = f"{CPU_LIBRARY.name}.nchwc_to_nchw"
SPATIAL_MEAN_FUNC = f"{CPU_LIBRARY.name}.nchwc_spatial_mean"

ELEMENTWISE_UNARY = frozenset({
    "relax.nn.relu", "relax.clip", "relax.sigmoid", "relax.tanh", "relax.nn.gelu", "relax.nn.silu",
})
ELEMENTWISE_BINARY = frozenset({
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum",
})
POOLS = frozenset({"relax.nn.max_pool2d", "relax.nn.avg_pool2d"})
# A channel count off the block is padded with zero channels up to the next multiple where that
# adds at most this share of work (MobileNetV3's 72, 120, 184, 200 with B = 16; not 24 or 40).
MAX_PADDING = 1 / 8


def padded_channels(channels: int, block: int) -> int | None:
    """The channels a blocked value of `channels` holds: `channels` rounded up to a multiple of
    the block, where that pads at most `MAX_PADDING` more; None where it pads more."""
    padded = -(-channels // block) * block
    return padded if padded - channels <= MAX_PADDING * channels else None


def blocked_override() -> int | None:
    """`$GIMLET_CPU_BLOCKED_LAYOUT`: 8 or 16 runs every function the pass sees blocked with that
    block, 0 none; None where it is unset (`blocked_layout_for` decides)."""
    override = os.environ.get(BLOCKED_LAYOUT_ENV, "").strip()
    if not override:
        return None
    if override not in ("0", "8", "16"):
        raise CompileError(f"${BLOCKED_LAYOUT_ENV} must be 0, 8 or 16, not {override!r}")
    return int(override)


def blocked_layout_for(func: relax.Function, cpu_block: int) -> bool:
    """Whether a function runs blocked by default: one with a conv the pass converts that is
    no entry conv (a function whose only such convs are entry convs would pay a conversion
    back for nothing), on a CPU with blocked kernels (`cpu_block`, `direct_conv_block()`, not 0).

    benchmarks/README.md ("Blocked layout", "Direct convs on a phase-plane grid") has the
    measurements: mobilenet_cnn ran in less time blocked (its 1x1 convs as GEMM tiles on
    blocked data beat im2col + OpenBLAS), and so does resnet_cnn since the direct kernel's
    tiles run on a grid (stores of whole vectors, vector epilogues); ResNets' 3x3 stride-1
    convs run Winograd on the blocked layout too (ResNet-18 0.91x, ResNet-50 0.97x the time
    of cutting the region at each of them into NCHW Winograd)."""
    if cpu_block == 0:
        return False
    found = []

    def visit(expr: relax.Expr) -> None:
        if (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.nn.conv2d"
                and _convertible(expr, cpu_block) and not _entry_conv(expr, cpu_block)):
            found.append(expr)

    relax.analysis.post_order_visit(func.body, visit)
    return bool(found)


@tvm.transform.module_pass(opt_level=0, name="BlockedLayout")
class BlockedLayout:  # pylint: disable=too-few-public-methods
    """Rewrite regions of NCHW convs (with the layout-agnostic ops between them) to NCHW{B}c,
    converting layouts at the regions' edges only."""

    def __init__(self, block: int | None = None):
        """`block` (8 or 16) converts every function with that block, 0 none; None: as
        `$GIMLET_CPU_BLOCKED_LAYOUT` or `blocked_layout_for` say."""
        self.block = block

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        """IRModule-level transformation."""
        override = blocked_override() if self.block is None else self.block
        block = direct_conv_block() if override is None else override
        if block == 0:
            return mod
        converted = [g_var for g_var, func in mod.functions_items()
                     if isinstance(func, relax.Function) and (override is not None or blocked_layout_for(func, block))]
        if not converted:
            return mod
        # A batch norm that folded into no conv decomposed into a tuple whose first field the
        # graph reads: canonicalized, the ops after it read the field's value directly, so they
        # see a blocked value (DenseNet's pre-activation batch norms otherwise left the layout
        # through the tuple: a conversion each way around each of 62 ReLUs). Only the
        # functions converted here: on others (ONNX's STFT test) FuseTIR failed after it.
        canonical = relax.transform.CanonicalizeBindings()(mod)
        rewriter = _BlockedRewriter(mod)
        rewriter.block = block
        rewriter.winograd = winograd_override()
        for g_var in converted:
            rewriter.blocked, rewriter.nchw, rewriter.edges = {}, {}, {}
            rewriter.builder_.update_func(g_var, rewriter.visit_expr(canonical[g_var.name_hint]))
        return rewriter.builder_.get()


def _shape(expr: relax.Expr) -> list[int | None] | None:
    """The float32 tensor's shape, None for each symbolic extent; None for anything else."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None or ty.dtype != "float32":
        return None
    return [int(d) if isinstance(d, tvm.tirx.IntImm) else None for d in ty.shape]


def _depthwise(conv: relax.Call) -> bool:
    """A conv2d with one group per channel and channel multiplier 1."""
    data, weight, out = _shape(conv.args[0]), _shape(conv.args[1]), _shape(conv)
    return (None not in (data, weight, out) and len(data) == len(weight) == len(out) == 4
            and data[1] is not None and int(conv.attrs.groups) == data[1] == out[1] and weight[1] == 1)


def _whole_block_groups(conv: relax.Call, block: int) -> bool:
    """A grouped conv (not depthwise) whose groups' input and output channels fill whole blocks
    (ResNeXt-50's 32 groups of 16 and 32 channels; not its 4- and 8-channel groups)."""
    data, out, groups = _shape(conv.args[0]), _shape(conv), int(conv.attrs.groups)
    return groups > 1 and not data[1] % (groups * block) and not out[1] % (groups * block)


def _static_nchw_conv(conv: relax.Call) -> tuple[list, list, list] | None:
    """The data, weight and output shapes of an NCHW / OIHW float32 conv2d whose extents are
    static but for the batch; None for any other."""
    attrs = conv.attrs
    data_shape, weight_shape, out_shape = _shape(conv.args[0]), _shape(conv.args[1]), _shape(conv)
    if (data_shape is None or weight_shape is None or out_shape is None or attrs.data_layout != "NCHW"
            or attrs.kernel_layout != "OIHW" or attrs.out_layout != "NCHW" or len(data_shape) != 4
            or None in weight_shape or None in data_shape[1:] or None in out_shape[1:]):
        return None
    return data_shape, weight_shape, out_shape


def _convertible(conv: relax.Call, block: int, winograd: int | None = None) -> bool:
    """Whether the pass runs this conv2d blocked (see the module docstring; `winograd`:
    `$GIMLET_CPU_WINOGRAD`): its output, and its data unless it is an entry conv."""
    shapes = _static_nchw_conv(conv)
    if shapes is None:
        return False
    data_shape, weight_shape, out_shape = shapes
    in_c, out_c, groups = data_shape[1], out_shape[1], int(conv.attrs.groups)
    if groups != 1 and not _depthwise(conv):
        return _whole_block_groups(conv, block)
    if padded_channels(out_c, block) is None:
        return False
    if out_c % block and not isinstance(conv.args[1], tvm.ir.GenericConst):
        return False  # padding the weight with zero channels needs its values
    return groups != 1 or not in_c % block or not _runs_winograd(conv, weight_shape, out_shape, winograd)


def _exit_conv(conv: relax.Call, block: int, winograd: int | None = None) -> bool:
    """A groups-1 conv on blocked data whose output channels are off the block and not padded
    (MobileNetV2's 24-channel projections, `padded_channels`): it writes NCHW, so the region ends
    at it without a conversion."""
    shapes = _static_nchw_conv(conv)
    if shapes is None:
        return False
    _, weight_shape, out_shape = shapes
    return (int(conv.attrs.groups) == 1 and bool(out_shape[1] % block) and not _convertible(conv, block, winograd)
            and not _runs_winograd(conv, weight_shape, out_shape, winograd))


def _entry_conv(conv: relax.Call, block: int) -> bool:
    """A convertible conv whose input channels are no multiple of the block (a network's
    3-channel stem): it reads its NCHW data as it is and writes the blocked layout, as
    onnxruntime's first NCHWc conv does, so the region starts at it with no conversion."""
    return bool(_shape(conv.args[0])[1] % block)


def _runs_winograd(conv: relax.Call, weight_shape: list[int], out_shape: list[int], winograd: int | None) -> bool:
    """Whether the CPU library would run this groups-1 conv with Winograd (on NCHW, or on
    blocked data and output alike)."""
    attrs = conv.attrs
    if not (isinstance(conv.args[1], tvm.ir.GenericConst) and tuple(weight_shape[2:]) == (3, 3)
            and [int(s) for s in attrs.strides] == [1, 1] and [int(d) for d in attrs.dilation] == [1, 1]):
        return False
    if winograd is not None:
        return winograd != 0
    return winograd_tile_for(weight_shape[0], weight_shape[1], (3, 3), tuple(out_shape[2:]), direct_conv_block()) != 0


def _broadcasts_per_channel(shape: list, out_shape: list) -> bool:
    """An operand of `shape` (NCHW) broadcast to `out_shape` keeps its channels: its blocked
    value [N, C / B, H, W, B] broadcasts the same way, over the batch and spatial axes only."""
    analyzer = tvm.sym.Analyzer()

    def kept_or_one(axis: int) -> bool:
        extent = shape[axis]
        return analyzer.can_prove_equal(extent, out_shape[axis]) or (
            isinstance(extent, tvm.tirx.IntImm) and int(extent) == 1)

    return (len(shape) == len(out_shape) == 4 and analyzer.can_prove_equal(shape[1], out_shape[1])
            and all(kept_or_one(axis) for axis in (0, 2, 3)))


def _one_pixel(h: tvm.ir.Expr, w: tvm.ir.Expr) -> bool:
    return all(isinstance(d, tvm.tirx.IntImm) and int(d) == 1 for d in (h, w))


def _to_blocked(x: relax.Expr, block: int, padding: float = 0.0) -> relax.Expr:
    """`x` [N, C, H, W] as [N, ceil(C / B), H, W, B], channels past C set to `padding`: a
    conversion (padding 0), or, for one pixel (a pooled vector), a reshape (the same order)."""
    n, c, h, w = x.ty.shape
    blocks = (c + block - 1) // block
    shape = [n, blocks, h, w, block]
    if _one_pixel(h, w):
        if int(c) % block:
            x = relax.op.nn.pad(x, [0, 0, 0, blocks * block - c, 0, 0, 0, 0], pad_value=padding)
        return relax.op.reshape(x, shape)
    assert padding == 0.0, "the conversion pads with 0"
    return relax.call_dps_packed(TO_BLOCKED_FUNC, [x], relax.TensorType(shape, "float32"))


def _to_nchw(x: relax.Expr, block: int, channels: tvm.ir.PrimExpr) -> relax.Expr:
    """`x` [N, ceil(C / B), H, W, B] back as [N, C, H, W], `channels` C (see `_to_blocked`)."""
    n, blocks, h, w, _ = x.ty.shape
    if _one_pixel(h, w):
        x = relax.op.reshape(x, [n, blocks * block, h, w])
        return relax.op.strided_slice(x, [1], [0], [channels]) if int(channels) % block else x
    return relax.call_dps_packed(FROM_BLOCKED_FUNC, [x], relax.TensorType([n, channels, h, w], "float32"))


def _padded_weight(weight: relax.Expr, out_c: int, in_c: int) -> relax.Expr | None:
    """The OIHW `weight` with zero output and input channels added up to `out_c` and `in_c`: a
    padded channel's output is 0 (with its 0 bias) and a padded input channel, whatever it
    holds, adds nothing. None for a weight that is not a constant and needs padding."""
    o, i = (int(weight.ty.shape[axis]) for axis in (0, 1))
    if (o, i) == (out_c, in_c):
        return weight
    if not isinstance(weight, tvm.ir.GenericConst):
        return None
    values = weight.value.numpy()
    padded = np.zeros((out_c, in_c, *values.shape[2:]), values.dtype)
    padded[:o, :i] = values
    return relax.const(padded)


@mutator
class _BlockedRewriter(PyExprMutator):  # pylint: disable=abstract-method
    block = 16
    winograd: int | None = None
    blocked: dict = {}  # NCHW var -> its blocked value (a var bound in the builder)
    nchw: dict = {}  # NCHW var only blocked so far -> the transform back, once emitted
    edges: dict = {}  # NCHW var a blocked op reads -> its transform into the blocked layout

    def visit_var_(self, var: relax.Var) -> relax.Expr:  # pylint: disable=arguments-renamed
        """A use that needs NCHW: the transform back from the blocked value (once)."""
        if var in self.blocked:
            if var not in self.nchw:
                self.nchw[var] = self.builder_.emit(_to_nchw(self.blocked[var], self.block, var.ty.shape[1]))
            return self.nchw[var]
        return super().visit_var_(var)

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:  # pylint: disable=arguments-renamed
        return self.visit_var_(var)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:  # pylint: disable=arguments-renamed
        value = binding.value
        rewritten = None
        if (self.builder_.current_block_is_dataflow() and isinstance(value, relax.Call)
                and isinstance(value.op, tvm.ir.Op)):
            rewritten = self._blocked_op(value)
        if rewritten is None:
            super().visit_var_binding_(binding)
            return
        rewritten = self.builder_.normalize(rewritten)
        if rewritten.ty.ndim != 5:  # an exit conv or a spatial mean: the value is NCHW again
            emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output
            self.set_var_remap(binding.var, emit(rewritten))
            return
        blocked_var = self.builder_.emit(rewritten)
        self.blocked[binding.var] = blocked_var
        if not isinstance(binding.var, relax.DataflowVar):  # a block's output leaves in NCHW
            self.nchw[binding.var] = self.builder_.emit_output(
                _to_nchw(blocked_var, self.block, binding.var.ty.shape[1]))

    def _operand(self, expr: relax.Expr) -> relax.Expr | None:
        """`expr`'s blocked value, where it has one."""
        return self.blocked.get(expr) if isinstance(expr, relax.Var) else None

    def _edge(self, expr: relax.Expr) -> relax.Expr:
        """`expr` (NCHW) in the blocked layout: its blocked value, else a transform (once)."""
        blocked = self._operand(expr)
        if blocked is not None:
            return blocked
        if expr not in self.edges:
            self.edges[expr] = self.builder_.emit(_to_blocked(self.visit_expr(expr), self.block))
        return self.edges[expr]

    def _blocked_op(self, call: relax.Call) -> relax.Expr | None:
        name = call.op.name
        if name == "relax.nn.conv2d":
            return self._blocked_conv(call)
        if name in ELEMENTWISE_UNARY or name in POOLS:
            data = self._operand(call.args[0])
            if data is None:
                return None
            if name in POOLS:
                if call.attrs.layout != "NCHW" or call.attrs.out_layout != "NCHW":
                    return None
                return self._pool(call, data)
            return relax.Call(call.op, [data, *call.args[1:]], call.attrs)
        if name == "relax.mean":
            return self._spatial_mean(call)
        if name == "relax.concat":
            return self._channel_concat(call)
        if name in ELEMENTWISE_BINARY:
            lhs, rhs = call.args
            blocked_lhs, blocked_rhs = self._operand(lhs), self._operand(rhs)
            blocked_shapes = [x.ty.shape for x, b in ((lhs, blocked_lhs), (rhs, blocked_rhs)) if b is not None]
            if not blocked_shapes or not all(_broadcasts_per_channel(shape, call.ty.shape) for shape in blocked_shapes):
                return None
            # A divisor's padded channels hold 1, not 0: what they compute stays finite (a
            # padded input channel adds nothing to a conv only while it is not NaN).
            divisor_padding = 1.0 if name == "relax.divide" else 0.0
            if divisor_padding and blocked_rhs is not None and int(call.ty.shape[1]) % self.block:
                return None
            if blocked_lhs is None:
                blocked_lhs = self._side_operand(lhs, call)
            if blocked_rhs is None:
                blocked_rhs = self._side_operand(rhs, call, divisor_padding)
            if blocked_lhs is None or blocked_rhs is None:
                return None
            return relax.Call(call.op, [blocked_lhs, blocked_rhs], call.attrs)
        return None

    def _side_operand(self, expr: relax.Expr, call: relax.Call, padding: float = 0.0) -> relax.Expr | None:
        """The other operand of a binary op on a blocked tensor, as it broadcasts against the
        blocked layout: a scalar as it is, a tensor of the output's shape through a transform
        (an edge, as a conv's data; padded channels 0, so not where `padding` is another
        value), a per-channel vector ([1, C, 1, 1] or [N, C, 1, 1]: an SE block's gate)
        reshaped to [., ceil(C / B), 1, 1, B] (the same order: no copy but the padding), a
        constant one reblocked here with numpy; channels past C hold `padding`."""
        shape, out_shape = _shape(expr), _shape(call)
        if shape is None or out_shape is None or len(out_shape) != 4:
            return None
        analyzer = tvm.sym.Analyzer()
        channels = out_shape[1]
        if isinstance(expr, relax.Var) and len(shape) == 4:
            if all(analyzer.can_prove_equal(a, b) for a, b in zip(expr.ty.shape, call.ty.shape)):
                return self._edge(expr) if padding == 0.0 or not channels % self.block else None
        if all(d == 1 for d in shape):
            return expr if len(shape) <= 5 else None
        padded = [1] * (4 - len(shape)) + shape
        if len(shape) > 4 or padded[1:] != [channels, 1, 1]:
            return None
        blocks = -(-channels // self.block)
        if isinstance(expr, tvm.ir.GenericConst) and padded[0] == 1:
            vector = np.full(blocks * self.block, padding, np.float32)
            vector[:channels] = expr.value.numpy().reshape(channels)
            return relax.const(vector.reshape(1, blocks, 1, 1, self.block))
        batch = expr.ty.shape[0] if len(shape) == 4 else 1
        if len(shape) == 4 and not (padded[0] == 1 or analyzer.can_prove_equal(batch, call.ty.shape[0])):
            return None
        vector = relax.op.reshape(self.visit_expr(expr), [batch, channels, 1, 1])
        return _to_blocked(self.builder_.emit(vector), self.block, padding)

    def _channel_concat(self, call: relax.Call) -> relax.Expr | None:
        """A concat along the channels of 4-D tensors whose channel counts are multiples of B,
        one of them blocked: the blocked values concatenated along the channel blocks (the
        others through a transform); None for other concats."""
        parts = call.args[0]
        if isinstance(parts, relax.Var):
            parts = self.lookup_binding(parts)
        if not isinstance(parts, relax.Tuple) or call.attrs.axis is None or call.ty.ndim != 4:
            return None
        if int(call.attrs.axis) % 4 != 1 or not any(self._operand(part) is not None for part in parts.fields):
            return None
        shapes = [_shape(part) for part in parts.fields]
        if any(shape is None or len(shape) != 4 or shape[1] is None or shape[1] % self.block for shape in shapes):
            return None
        return relax.op.concat([self._edge(part) for part in parts.fields], axis=1)

    def _spatial_mean(self, call: relax.Call) -> relax.Expr | None:
        """A mean over axes 2 and 3 of a blocked value, as an NCHW-ordered result (see the
        module docstring); None for other means."""
        data = self._operand(call.args[0])
        if data is None or call.attrs.axis is None:
            return None
        if sorted(int(a) % 4 for a in call.attrs.axis) != [2, 3]:
            return None
        n, blocks, _, _, block = data.ty.shape
        mean = relax.call_dps_packed(SPATIAL_MEAN_FUNC, [data], relax.TensorType([n, blocks, 1, 1, block], "float32"))
        channels = call.args[0].ty.shape[1]
        return relax.op.reshape(_to_nchw(self.builder_.emit(mean), self.block, channels), call.ty.shape)

    def _pool(self, call: relax.Call, data: relax.Expr) -> relax.Expr:
        attrs, layout = call.attrs, f"NCHW{self.block}c"
        pool = relax.op.nn.max_pool2d if call.op.name == "relax.nn.max_pool2d" else relax.op.nn.avg_pool2d
        return pool(data, attrs.pool_size, attrs.strides, attrs.padding, attrs.dilation, attrs.ceil_mode,
                    attrs.count_include_pad, layout, layout)

    def _blocked_conv(self, call: relax.Call) -> relax.Expr | None:
        """The conv on blocked data (an entry conv: NCHW data) writing blocked output (an exit
        conv: NCHW), its weight padded with zero channels where the blocked values are."""
        data, weight = call.args
        attrs = call.attrs
        layout = f"NCHW{self.block}c"
        out_c, groups = int(call.ty.shape[1]), int(attrs.groups)
        if self._operand(data) is not None and _exit_conv(call, self.block, self.winograd):
            data = self._operand(data)
            weight = _padded_weight(self.visit_expr(weight), out_c, int(data.ty.shape[1]) * self.block)
            if weight is None:
                return None
            return relax.op.nn.conv2d(data, weight, attrs.strides, attrs.padding, attrs.dilation, groups,
                                      layout, "OIHW", "NCHW")
        if not _convertible(call, self.block, self.winograd):
            return None
        if self._operand(data) is None and _entry_conv(call, self.block) and groups == 1:
            data, data_layout = self.visit_expr(data), "NCHW"
            in_c = int(data.ty.shape[1])
        else:
            data, data_layout = self._edge(data), layout
            in_c = int(data.ty.shape[1]) * self.block
        out_padded = padded_channels(out_c, self.block)
        if _depthwise(call):  # one group per (padded) channel
            weight, groups = _padded_weight(self.visit_expr(weight), out_padded, 1), out_padded
        elif groups != 1:  # groups of whole blocks: nothing padded
            weight = self.visit_expr(weight)
        else:
            weight = _padded_weight(self.visit_expr(weight), out_padded, in_c)
        if weight is None:
            return None
        return relax.op.nn.conv2d(data, weight, attrs.strides, attrs.padding, attrs.dilation, groups,
                                  data_layout, "OIHW", layout)
