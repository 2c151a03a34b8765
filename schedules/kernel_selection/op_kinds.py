"""The ops kernel selection chooses kernels for, one `OpKind` each in `OP_KINDS`: how to find
the op's group in a module (the plain Relax op, or the CPU library call that took it with its
epilogue), the op itself as Relax, what it computes (float64 numpy), the shapes it is checked
at besides its own and the inputs it is checked on.

- matmul: an operand of rank >= 2 by a rank-2 one (every linear layer), with the epilogue
  `DispatchCPULibrary` absorbs (bias and residual adds, ReLU, GELU);
- attention: `R.nn.attention` over BSNH query, key and value with an optional 4-D additive
  bias (a padding mask), no causal mask or window; no epilogue;
- conv2d: `R.nn.conv2d` with NCHW data and output and OIHW weights (any strides, padding,
  dilation and groups), with the epilogue `DispatchCPULibrary` absorbs;
- conv2d_nchwc: the same on NCHW{B}c data and output (what `BlockedLayout` writes), groups 1,
  as `DispatchCPULibrary` groups it where its library has a choice of algorithms for it (the
  generic `BLOCKED_CONV2D_FUNC` call); no TIR legalization (`OpKind.legalizes`);
- layer_norm, rms_norm: `R.nn.layer_norm` (x, gamma, beta) and `R.nn.rms_norm` (x, gamma) over
  the last k axes of x, k being gamma's rank (what the ONNX importer and `FuseNormalization`
  emit for LayerNormalization, RMSNormalization and their written-out chains); no epilogue;
- dequant_gemv: the LLM's decode GEMV over a weight in a GGUF block format, a `call_tir` of
  the kernel `targets.kernels.dequant_gemv` marks (found by that mark, which needs the module:
  `find_in`); rows-generic (`OpKind.rows_generic`).

Operands may differ in dtype (`OpKind.operand_dtypes`; the signature's dtype is the first
operand's and the output's).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tvm
from tvm import relax

from ...relax_passes.dispatch_cpu_library import (BLOCKED_CONV2D_FUNC, CONV2D_FUNC, library_attention,
                                                   library_conv2d, library_matmul, transposed_constant)
from ...targets.kernels import STEP_ACTIVATIONS, Shape, Step
from ...targets.kernels.dequant_gemv import BLOCK, BLOCK_FORMAT, DEQUANT_GEMV, HALF, LAYOUTS, OP_GROUP, dequant_gemv

Attrs = tuple[tuple[str, float], ...]


@dataclasses.dataclass
class Group:
    """An op group as found in a module: the op's tensor operands and attributes, then its
    epilogue (`steps`) with the addends of its adds in order."""

    operands: list[relax.Expr]
    attrs: Attrs
    addends: list[relax.Expr]
    steps: list[Step]


def static_shape(expr: relax.Expr) -> Shape | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None or not hasattr(ty.shape, "values"):
        return None
    if not all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape.values):
        return None
    return tuple(int(d) for d in ty.shape.values)


def _with_epilogue(operands: list[relax.Expr], attrs: Attrs, library_steps: list,
                   vectors_on_any_axis: bool) -> Group | None:
    """The group of a library call with its epilogue (`library_matmul`'s steps); None when an
    addend's shape is not static, or it is a vector along another axis than the output's
    last (a divisor above 1) and not `vectors_on_any_axis`, or an activation is none of
    `STEP_ACTIVATIONS`."""
    addends, steps = [], []
    for step in library_steps:
        if step[0] in ("add", "add_blocked"):  # add_blocked: a blocked output's per-channel vector
            shape = static_shape(step[1])
            if shape is None or (step[2] != 1 and not vectors_on_any_axis):
                return None
            addends.append(step[1])
            steps.append(("add", shape))
        elif step[0] in STEP_ACTIVATIONS:
            steps.append((step[0], ()))
        else:
            return None
    return Group(operands, attrs, addends, steps)


def _is_op(call: relax.Expr, *names: str) -> bool:
    return isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op) and call.op.name in names


class OpKind:
    """One op. `find` reads its groups; the rest works on static shapes.

    `rows_generic`: the op's first operand and its output lead with a row axis of any length
    (symbolic in a model): a signature has 1 row there, and a kernel from outside takes the
    row count as its first argument (`int64_t rows`); verification also runs it at
    `variants`. `baseline`: where the op is itself a shipped TIR kernel (a `call_tir`), that
    kernel's file: the "generated" candidate keeps the call. `inf_may_be_nan`: an output the
    reference has infinite may be NaN (a kernel that factors its sum may meet Inf - Inf).
    `legalizes`: LegalizeOps lowers the op to TIR (a "generated" candidate exists)."""

    name = ""
    rows_generic = False
    baseline: str | None = None
    inf_may_be_nan = False
    legalizes = True

    def find(self, call: relax.Expr) -> Group | None:
        """The op group `call` is, or None."""
        raise NotImplementedError

    def find_in(self, call: relax.Expr, mod: tvm.IRModule | None) -> Group | None:
        """The op group `call` is, or None, where the call's module is `mod` (None: unknown):
        for a kind whose calls are found by the function they call."""
        return self.find(call)

    def shapes_of(self, operands: list[relax.Expr]) -> list[Shape | None]:
        """The operands' shapes in a signature (None: not static)."""
        return [static_shape(x) for x in operands]

    def operand_dtypes(self, dtype: str, attrs: Attrs, count: int) -> tuple[str, ...]:
        """The dtype of each of `count` operands of a group of `dtype` (all of it, by default)."""
        return (dtype,) * count

    def input_sets(self, shapes: tuple[Shape, ...], attrs: Attrs,
                   rng: np.random.Generator) -> dict[str, list[np.ndarray]] | None:
        """The op's own input sets (float64 arrays, exact in the operands' dtypes), or None for
        `OpSignature.input_sets`' generic ones."""
        return None

    def variants(self, shapes: tuple[Shape, ...]) -> list[tuple[Shape, ...]]:
        """Other operand shapes every candidate is checked at (a rows-generic op's row counts)."""
        return []

    def valid(self, shapes: tuple[Shape, ...]) -> bool:
        """Whether selection handles the op at these operand shapes."""
        raise NotImplementedError

    def emit(self, operands: list[relax.Expr], attrs: Attrs) -> relax.Call:
        """The op on `operands` as a Relax call (no epilogue)."""
        raise NotImplementedError

    def out_shape(self, shapes: tuple[Shape, ...], attrs: Attrs) -> Shape:
        raise NotImplementedError

    def reduction(self, shapes: tuple[Shape, ...], attrs: Attrs) -> int:
        """Multiply-adds per output element (1 for a kind without a reduction to speak of)."""
        return 1

    def multiply_adds(self, shapes: tuple[Shape, ...], attrs: Attrs) -> int:
        """The op's work, roughly: output elements times `reduction`."""
        return math.prod(self.out_shape(shapes, attrs)) * self.reduction(shapes, attrs)

    def reference(self, operands: list[np.ndarray], attrs: Attrs) -> np.ndarray:
        """What the op computes on float64 operands."""
        raise NotImplementedError

    def edge_shapes(self, shapes: tuple[Shape, ...], attrs: Attrs) -> tuple[Shape, ...]:
        """Operand shapes of the same rank that are no multiple of any tile (tails everywhere)."""
        raise NotImplementedError

    def describe(self, shapes: tuple[Shape, ...], weight: bool) -> str:
        """The operands in the signature's key."""
        return " ".join("x".join(map(str, s)) for s in shapes)

    def describe_attrs(self, attrs: Attrs) -> list[str]:
        """The attributes in the signature's key."""
        return [f"{name}={value:g}" for name, value in attrs]

    def large(self, operand: int) -> bool:
        """Whether the "large" input set scales this operand (by 1e3)."""
        return True

    def error_scale(self, operands: list[np.ndarray]) -> float:
        """The magnitude the op's float32 rounding error is relative to."""
        raise NotImplementedError

    def own_input_sets(self, normal: list[np.ndarray], attrs: Attrs) -> dict[str, list[np.ndarray]]:
        """Input sets of the op's own, made from the random normal operands, beyond those every
        op is checked on (`OpSignature.input_sets`): where this op's kernels go wrong."""
        return {}

    def kernel_operands(self, shapes: tuple[Shape, ...], attrs: Attrs) -> list[tuple[str, Shape]]:
        """The name and shape of each array an outside kernel takes (`OpSignature.kernel_operands`),
        for an op whose kind says so."""
        raise ValueError(f"no kernel from outside the compiler is taken for {self.name}")

    def error_scale_of(self, operands: list[np.ndarray], attrs: Attrs) -> float:
        """`error_scale` for a kind whose operands need the group's attributes to read."""
        return self.error_scale(operands)


class Matmul(OpKind):
    name = "matmul"
    EDGE_DIMS = (11, 37, 69)  # rows, reduction, columns

    def find(self, call: relax.Expr) -> Group | None:
        if _is_op(call, "relax.matmul"):
            return Group(list(call.args), (), [], [])
        parts = library_matmul(call)
        if parts is None:
            return None
        a, b, transposed, library_steps = parts
        if transposed:
            # A constant the dispatch transposed (a one-row matmul's weight) is the group's
            # [K, N] weight again; another transposed b is not a candidate's input.
            if not isinstance(b, tvm.ir.GenericConst):
                return None
            b = transposed_constant(b)
        return _with_epilogue([a, b], (), library_steps, vectors_on_any_axis=False)

    def valid(self, shapes: tuple[Shape, ...]) -> bool:
        a, b = shapes
        return len(a) >= 2 and len(b) == 2 and a[-1] == b[0]

    def emit(self, operands: list[relax.Expr], attrs: Attrs) -> relax.Call:
        return relax.op.matmul(*operands)

    def out_shape(self, shapes: tuple[Shape, ...], attrs: Attrs) -> Shape:
        a, b = shapes
        return (*a[:-1], b[1])

    def reduction(self, shapes: tuple[Shape, ...], attrs: Attrs) -> int:
        return shapes[0][-1]

    def reference(self, operands: list[np.ndarray], attrs: Attrs) -> np.ndarray:
        return operands[0] @ operands[1]

    def edge_shapes(self, shapes: tuple[Shape, ...], attrs: Attrs) -> tuple[Shape, ...]:
        m, k, n = self.EDGE_DIMS
        return (*[1] * (len(shapes[0]) - 2), m, k), (k, n)

    def describe(self, shapes: tuple[Shape, ...], weight: bool) -> str:
        a, b = ("x".join(map(str, s)) for s in shapes)
        return " ".join([a, "@", *(["const"] if weight else []), b])

    def error_scale(self, operands: list[np.ndarray]) -> float:
        return float((np.abs(operands[0]) @ np.abs(operands[1])).max(initial=0))


class Attention(OpKind):
    name = "attention"
    EDGE = (11, 13, 3, 37)  # query rows, key rows, heads, head size

    def find(self, call: relax.Expr) -> Group | None:
        if _is_op(call, "relax.nn.attention", "relax.nn.attention_bias"):
            if call.attrs.causal_mask is not None or call.attrs.window_size is not None:
                return None
            operands = list(call.args)
            scale = call.attrs.scale
            if scale is None:
                depth = static_shape(operands[0])
                if depth is None:
                    return None
                return Group(operands, (("scale", 1 / math.sqrt(depth[3])),), [], [])
            return Group(operands, (("scale", float(scale.value)),), [], [])
        parts = library_attention(call)
        if parts is None:
            return None
        operands, scale = parts
        return Group(operands, (("scale", scale),), [], [])

    def valid(self, shapes: tuple[Shape, ...]) -> bool:
        if len(shapes) not in (3, 4) or any(len(s) != 4 for s in shapes):
            return False
        (b, s, n, h), (kb, t, kn, kh), (vb, vt, vn, _) = shapes[:3]
        full_bias = (b, n, s, t)
        return ((kb, kn, kh) == (b, n, h) and (vb, vt, vn) == (b, t, n)
                and all(d in (1, full) for d, full in zip(shapes[3] if len(shapes) == 4 else (), full_bias)))

    def emit(self, operands: list[relax.Expr], attrs: Attrs) -> relax.Call:
        return relax.op.nn.attention(*operands, scale=dict(attrs)["scale"])

    def out_shape(self, shapes: tuple[Shape, ...], attrs: Attrs) -> Shape:
        (b, s, n, _), _, v = shapes[:3]
        return (b, s, n, v[3])

    def reduction(self, shapes: tuple[Shape, ...], attrs: Attrs) -> int:
        (_, _, _, h), (_, t, _, _), v = shapes[:3]
        return t + t * h // v[3]  # the weighted sum's, and the scores' spread over the outputs

    def reference(self, operands: list[np.ndarray], attrs: Attrs) -> np.ndarray:
        q, k, v = operands[:3]
        scores = np.einsum("bsnh,btnh->bnst", q, k) * dict(attrs)["scale"]
        if len(operands) == 4:
            scores = scores + operands[3]
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        return np.einsum("bnst,btnv->bsnv", weights, v)

    def edge_shapes(self, shapes: tuple[Shape, ...], attrs: Attrs) -> tuple[Shape, ...]:
        s, t, n, h = self.EDGE
        edge = ((1, s, n, h), (1, t, n, h), (1, t, n, h))
        if len(shapes) == 3:
            return edge
        return (*edge, tuple(1 if d == 1 else full for d, full in zip(shapes[3], (1, n, s, t))))

    def large(self, operand: int) -> bool:
        # Scores of 1e3-scaled queries and keys differ by more than float32 resolves: softmax
        # of those is rounding, not the op; values and bias may be large.
        return operand >= 2

    def error_scale(self, operands: list[np.ndarray]) -> float:
        return float(np.abs(operands[2]).max(initial=0))  # outputs are convex sums of values


def _far_padding(size: int, kernel: int, stride: int, dilation: int, near: int, out: int) -> int:
    """Bottom (right) padding of a conv2d the library was given only the top (left) padding
    of: equal to it when that gives `out` rows, else the rows the output reaches below the
    input (more padding than that changes no output)."""
    if (size + 2 * near - dilation * (kernel - 1) - 1) // stride + 1 == out:
        return near
    return max(0, (out - 1) * stride + dilation * (kernel - 1) + 1 - size - near)


class Conv2d(OpKind):
    name = "conv2d"
    ATTRS = ("stride_h", "stride_w", "pad_top", "pad_left", "pad_bottom", "pad_right",
             "dilation_h", "dilation_w", "groups")
    EDGE = (13, 11, 3, 5)  # rows, columns, input and output channels per group
    LIBRARY_CALL = CONV2D_FUNC  # the generic call `DispatchCPULibrary`'s grouping run writes

    def layout(self, data: relax.Expr) -> str:
        """The data and output layout of the kind's convs."""
        return "NCHW"

    def find(self, call: relax.Expr) -> Group | None:
        if _is_op(call, "relax.nn.conv2d"):
            attrs = call.attrs
            layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
            out_dtype = attrs.out_dtype
            layout = self.layout(call.args[0])
            if layouts != (layout, "OIHW", layout) or out_dtype not in (None, call.args[0].ty.dtype):
                return None
            params = [*attrs.strides, *attrs.padding, *attrs.dilation, attrs.groups]
            return Group(list(call.args), tuple(zip(self.ATTRS, (float(int(p)) for p in params))), [], [])
        parts = library_conv2d(call, self.LIBRARY_CALL)
        if parts is None:
            return None
        data, weight, (sh, sw, top, left, dh, dw, groups), library_steps = parts
        shapes = static_shape(data), static_shape(weight), static_shape(call)
        if None in shapes:
            return None
        (h, w), (kh, kw), (oh, ow) = (shape[2:4] for shape in shapes)
        bottom, right = _far_padding(h, kh, sh, dh, top, oh), _far_padding(w, kw, sw, dw, left, ow)
        params = (sh, sw, top, left, bottom, right, dh, dw, groups)
        return _with_epilogue([data, weight], tuple(zip(self.ATTRS, map(float, params))), library_steps,
                              vectors_on_any_axis=True)

    def valid(self, shapes: tuple[Shape, ...]) -> bool:
        return len(shapes) == 2 and all(len(s) == 4 for s in shapes) and shapes[0][1] % shapes[1][1] == 0

    @staticmethod
    def _params(attrs: Attrs) -> dict[str, int]:
        return {name: int(value) for name, value in attrs}

    def emit(self, operands: list[relax.Expr], attrs: Attrs) -> relax.Call:
        p = self._params(attrs)
        layout = self.layout(operands[0])
        return relax.op.nn.conv2d(
            *operands, strides=(p["stride_h"], p["stride_w"]),
            padding=(p["pad_top"], p["pad_left"], p["pad_bottom"], p["pad_right"]),
            dilation=(p["dilation_h"], p["dilation_w"]), groups=p["groups"], data_layout=layout,
            out_layout=layout)

    def out_shape(self, shapes: tuple[Shape, ...], attrs: Attrs) -> Shape:
        return self.nchw_out_shape(shapes, attrs)

    def nchw_out_shape(self, shapes: tuple[Shape, ...], attrs: Attrs) -> Shape:
        """The NCHW output's shape for NCHW data and OIHW weight shapes."""
        p = self._params(attrs)
        (n, _, h, w), (o, _, kh, kw) = shapes
        oh = (h + p["pad_top"] + p["pad_bottom"] - p["dilation_h"] * (kh - 1) - 1) // p["stride_h"] + 1
        ow = (w + p["pad_left"] + p["pad_right"] - p["dilation_w"] * (kw - 1) - 1) // p["stride_w"] + 1
        return (n, o, oh, ow)

    def reduction(self, shapes: tuple[Shape, ...], attrs: Attrs) -> int:
        return math.prod(shapes[1][1:])  # input channels per group x kernel

    def reference(self, operands: list[np.ndarray], attrs: Attrs) -> np.ndarray:
        p = self._params(attrs)
        data, weight = operands
        n = data.shape[0]
        o, cpg, kh, kw = weight.shape
        _, _, oh, ow = self.nchw_out_shape((data.shape, weight.shape), attrs)
        padded = np.pad(data, ((0, 0), (0, 0), (p["pad_top"], p["pad_bottom"]), (p["pad_left"], p["pad_right"])))
        groups, opg = p["groups"], o // p["groups"]
        out = np.zeros((n, groups, opg, oh, ow))
        grouped_w = weight.reshape(groups, opg, cpg, kh, kw)
        for i in range(kh):
            for j in range(kw):
                rows = slice(i * p["dilation_h"], i * p["dilation_h"] + (oh - 1) * p["stride_h"] + 1, p["stride_h"])
                cols = slice(j * p["dilation_w"], j * p["dilation_w"] + (ow - 1) * p["stride_w"] + 1, p["stride_w"])
                window = padded[:, :, rows, cols].reshape(n, groups, cpg, oh, ow)
                out += np.einsum("ngchw,goc->ngohw", window, grouped_w[:, :, :, i, j])
        return out.reshape(n, o, oh, ow)

    def edge_shapes(self, shapes: tuple[Shape, ...], attrs: Attrs) -> tuple[Shape, ...]:
        p = self._params(attrs)
        o, cpg, kh, kw = shapes[1]
        groups = p["groups"]
        rows, cols, edge_cpg, edge_opg = self.EDGE
        edge_cpg, edge_opg = (1 if cpg == 1 else edge_cpg), (1 if o == groups else edge_opg)
        # Larger than the kernel's dilated extent: the kernel fits, padded or not.
        rows, cols = max(rows, p["dilation_h"] * (kh - 1) + 2), max(cols, p["dilation_w"] * (kw - 1) + 2)
        return (1, groups * edge_cpg, rows, cols), (groups * edge_opg, edge_cpg, kh, kw)

    def describe(self, shapes: tuple[Shape, ...], weight: bool) -> str:
        data, kernel = ("x".join(map(str, s)) for s in shapes)
        return " ".join([data, "*", *(["const"] if weight else []), kernel])

    def describe_attrs(self, attrs: Attrs) -> list[str]:
        p = self._params(attrs)
        return [f"stride {p['stride_h']}x{p['stride_w']}",
                f"pad {p['pad_top']},{p['pad_left']},{p['pad_bottom']},{p['pad_right']}",
                f"dilation {p['dilation_h']}x{p['dilation_w']}", f"groups {p['groups']}"]

    def error_scale(self, operands: list[np.ndarray]) -> float:
        data, weight = operands
        per_output = np.abs(weight).reshape(weight.shape[0], -1).sum(axis=1)
        return float(np.abs(data).max(initial=0) * per_output.max(initial=0))


class BlockedConv2d(Conv2d):
    """A groups-1 conv2d on NCHW{B}c data [N, C / B, H, W, B] and output [N, O / B, OH, OW, B]
    with an OIHW weight; worked out as the NCHW conv between the two layouts."""

    name = "conv2d_nchwc"
    LIBRARY_CALL = BLOCKED_CONV2D_FUNC
    legalizes = False

    def layout(self, data: relax.Expr) -> str:
        shape = static_shape(data)
        return f"NCHW{shape[4]}c" if shape is not None and len(shape) == 5 else ""

    @staticmethod
    def _nchw(shapes: tuple[Shape, ...]) -> tuple[Shape, ...]:
        """The data's shape as NCHW, the weight's as it is."""
        (n, blocks, h, w, block), weight = shapes
        return (n, blocks * block, h, w), weight

    def valid(self, shapes: tuple[Shape, ...]) -> bool:
        if len(shapes) != 2 or len(shapes[0]) != 5 or len(shapes[1]) != 4:
            return False
        block, (out_c, in_c, _, _) = shapes[0][4], shapes[1]
        return shapes[0][1] * block == in_c and out_c % block == 0  # groups 1, whole output blocks

    def out_shape(self, shapes: tuple[Shape, ...], attrs: Attrs) -> Shape:
        n, out_c, oh, ow = self.nchw_out_shape(self._nchw(shapes), attrs)
        block = shapes[0][4]
        return (n, out_c // block, oh, ow, block)

    def reference(self, operands: list[np.ndarray], attrs: Attrs) -> np.ndarray:
        data, weight = operands
        n, blocks, h, w, block = data.shape
        out = super().reference([data.transpose(0, 1, 4, 2, 3).reshape(n, blocks * block, h, w), weight], attrs)
        return out.reshape(n, -1, block, *out.shape[2:]).transpose(0, 1, 3, 4, 2)

    def edge_shapes(self, shapes: tuple[Shape, ...], attrs: Attrs) -> tuple[Shape, ...]:
        """The NCHW conv's edge rows and columns; one block of input channels, two of output."""
        (_, _, rows, cols), (_, _, kh, kw) = super().edge_shapes(self._nchw(shapes), attrs)
        block = shapes[0][4]
        return (1, 1, rows, cols, block), (2 * block, block, kh, kw)


class LayerNorm(OpKind):
    """`R.nn.layer_norm`: each row of x (its last k axes, k being gamma's rank) less its mean,
    divided by the square root of its biased variance plus epsilon, times gamma, plus beta."""

    name = "layer_norm"
    OP = "relax.nn.layer_norm"
    AFFINE = ("gamma", "beta")
    EDGE = (7, 3, 37)  # rows; each normalized axis but the last; the last (no multiple of a vector)
    OFFSET = 30.0
    """The "offset-rows" input set's mean, in standard deviations. There the variance taken as
    E[x^2] - E[x]^2 in float32 is 1.3 to 8 times the tolerance off (rows of 32 to 4096
    elements, sequential sums), two sequential float32 passes at most 0.2 times it."""

    def find(self, call: relax.Expr) -> Group | None:
        if not _is_op(call, self.OP) or not all(getattr(call.attrs, flag, True) for flag in ("center", "scale")):
            return None
        ndim, count = call.args[0].ty.ndim, len(call.attrs.axes)
        if ndim < 1 or [int(a) % ndim for a in call.attrs.axes] != list(range(ndim - count, ndim)):
            return None  # gamma's shape follows the axes' order: trailing axes, in order, only
        if call.attrs.epsilon <= 0:
            return None  # a constant row is 0/0: no float32 result to check a kernel against
        return Group(list(call.args), (("epsilon", float(call.attrs.epsilon)),), [], [])

    def valid(self, shapes: tuple[Shape, ...]) -> bool:
        if len(shapes) != 1 + len(self.AFFINE):
            return False
        x, normed = shapes[0], shapes[1]
        return 1 <= len(normed) <= len(x) and all(s == x[len(x) - len(normed):] for s in shapes[1:])

    def emit(self, operands: list[relax.Expr], attrs: Attrs) -> relax.Call:
        axes = list(range(-operands[1].ty.ndim, 0))
        return relax.op.nn.layer_norm(*operands, axes=axes, epsilon=dict(attrs)["epsilon"])

    def out_shape(self, shapes: tuple[Shape, ...], attrs: Attrs) -> Shape:
        return shapes[0]

    def _normalized(self, x: np.ndarray, axes: tuple[int, ...], epsilon: float) -> np.ndarray:
        centered = x - x.mean(axis=axes, keepdims=True)
        return centered / np.sqrt((centered * centered).mean(axis=axes, keepdims=True) + epsilon)

    def reference(self, operands: list[np.ndarray], attrs: Attrs) -> np.ndarray:
        x, gamma, *beta = operands
        normed = self._normalized(x, tuple(range(x.ndim - gamma.ndim, x.ndim)), dict(attrs)["epsilon"])
        return normed * gamma + (beta[0] if beta else 0.0)

    def edge_shapes(self, shapes: tuple[Shape, ...], attrs: Attrs) -> tuple[Shape, ...]:
        rows, inner, last = self.EDGE
        x, normed = shapes[0], shapes[1]
        leading = len(x) - len(normed)
        edge_rows = (*[1] * (leading - 1), rows) if leading else ()
        edge_normed = (*[inner] * (len(normed) - 1), last)
        return (edge_rows + edge_normed, *[edge_normed] * len(self.AFFINE))

    def large(self, operand: int) -> bool:
        # x 1e3 times larger normalizes to the same rows: the kernel must not overflow or lose
        # them. gamma and beta scale the output only, as random ones do.
        return operand == 0

    def error_scale(self, operands: list[np.ndarray]) -> float:
        # Each output's magnitude: |x normalized| |gamma| + |beta|, x normalized without epsilon
        # (larger: with it), a constant row's as 0.
        x, gamma, *beta = operands
        with np.errstate(invalid="ignore", divide="ignore"):
            normed = np.nan_to_num(self._normalized(x, tuple(range(x.ndim - gamma.ndim, x.ndim)), 0.0),
                                   nan=0.0, posinf=0.0, neginf=0.0)
        return float((np.abs(normed) * np.abs(gamma) + (np.abs(beta[0]) if beta else 0.0)).max(initial=0))

    def own_input_sets(self, normal: list[np.ndarray], attrs: Attrs) -> dict[str, list[np.ndarray]]:
        # Rows whose variance is about epsilon (which then decides the output), and rows far
        # from 0 relative to their spread (where the variance must not come from cancellation).
        x, *affine = normal
        return {"small-variance": [x * math.sqrt(dict(attrs)["epsilon"]), *affine],
                "offset-rows": [x + self.OFFSET, *affine]}

    def kernel_operands(self, shapes: tuple[Shape, ...], attrs: Attrs) -> list[tuple[str, Shape]]:
        # Rows of x folded into one axis and the normalized axes into another (as a matmul's
        # batch axes into M): one kernel interface for every rank.
        x, normed = shapes[0], shapes[1]
        rows, size = math.prod(x[:len(x) - len(normed)]), math.prod(normed)
        return [("x", (rows, size)), *((name, (size,)) for name in self.AFFINE), ("out", (rows, size))]


class RMSNorm(LayerNorm):
    """`R.nn.rms_norm`: each row of x (its last k axes) divided by the square root of its mean
    square plus epsilon, times gamma (no centring, no beta)."""

    name = "rms_norm"
    OP = "relax.nn.rms_norm"
    AFFINE = ("gamma",)

    def emit(self, operands: list[relax.Expr], attrs: Attrs) -> relax.Call:
        axes = list(range(-operands[1].ty.ndim, 0))
        return relax.op.nn.rms_norm(*operands, axes=axes, epsilon=dict(attrs)["epsilon"])

    def _normalized(self, x: np.ndarray, axes: tuple[int, ...], epsilon: float) -> np.ndarray:
        return x / np.sqrt((x * x).mean(axis=axes, keepdims=True) + epsilon)



class DequantGemv(OpKind):
    """x[rows, 1, k] @ W^T (+ bias[n]) -> out[rows, 1, n], W[n, k] given in a block format
    (`targets.kernels.dequant_gemv`): operands x (float32), scales (float16 [n, k / 32]),
    mins (Q4_1 only, likewise), quants (Q8_0: int8 [n, k]; Q4_1: uint8 [n, k / 2]), bias
    (float32 [n], if any). Attributes: `bits` (8: Q8_0, 4: Q4_1) and `bias` (1 or 0)."""

    name = DEQUANT_GEMV
    rows_generic = True
    baseline = "targets/kernels/dequant_gemv.py"
    inf_may_be_nan = True
    FORMATS = {8: "q8_0", 4: "q4_1"}  # by `bits`
    ODD_ROWS = 7  # the other row count checked: a tile of 4 rows and 3 left over
    EDGE = (37, 96)  # output features (no multiple of a task's rows), input features (3 blocks)

    def find(self, call: relax.Expr) -> Group | None:
        return None  # the mark is on the called PrimFunc: `find_in`

    def find_in(self, call: relax.Expr, mod: tvm.IRModule | None) -> Group | None:
        if mod is None or not _is_op(call, "relax.call_tir") or not isinstance(call.args[0], tvm.ir.GlobalVar):
            return None
        func = mod.functions.get(call.args[0])
        attrs = func.attrs if isinstance(func, tvm.tirx.PrimFunc) else None
        if attrs is None or attrs.get(OP_GROUP) != DEQUANT_GEMV:
            return None
        layout = LAYOUTS[str(attrs[BLOCK_FORMAT])]
        operands = list(call.args[1].fields)
        bits = next(b for b, name in self.FORMATS.items() if name == layout.name)
        bias = len(operands) == (4 if layout.has_mins else 3) + 1
        return Group(operands, (("bits", float(bits)), ("bias", float(bias))), [], [])

    @classmethod
    def layout(cls, attrs: Attrs):
        return LAYOUTS[cls.FORMATS[int(dict(attrs)["bits"])]]

    def shapes_of(self, operands: list[relax.Expr]) -> list[Shape | None]:
        ty = operands[0].ty
        x = ty.shape.values if isinstance(ty, relax.TensorType) and hasattr(ty.shape, "values") else None
        rest = [static_shape(w) for w in operands[1:]]
        if x is None or len(x) != 3 or not all(isinstance(d, tvm.tirx.IntImm) for d in x[1:]):
            return [None, *rest]
        return [(1, *(int(d) for d in x[1:])), *rest]

    def operand_dtypes(self, dtype: str, attrs: Attrs, count: int) -> tuple[str, ...]:
        layout = self.layout(attrs)
        scales = ("float16", "float16") if layout.has_mins else ("float16",)
        return (dtype, *scales, layout.quants_dtype, *((dtype,) if dict(attrs)["bias"] else ()))

    def valid(self, shapes: tuple[Shape, ...]) -> bool:
        x, scales = shapes[:2]
        return (len(x) == 3 and x[:2] == (1, 1) and x[2] % BLOCK == 0 and len(scales) == 2
                and scales[1] == x[2] // BLOCK)

    def emit(self, operands: list[relax.Expr], attrs: Attrs) -> relax.Call:
        """A `call_tir` of the shipped kernel, added to the current BlockBuilder's module."""
        layout, shapes = self.layout(attrs), self.shapes_of(operands)
        n, k = shapes[1][0], shapes[0][2]
        func = dequant_gemv(layout, n, k, bool(dict(attrs)["bias"]))
        gvar = relax.BlockBuilder.current().add_func(func, f"gemv_{layout.name}")
        rows = operands[0].ty.shape.values[0]
        return relax.call_tir(gvar, operands, relax.TensorType((rows, 1, n), operands[0].ty.dtype))

    def out_shape(self, shapes: tuple[Shape, ...], attrs: Attrs) -> Shape:
        return (shapes[0][0], 1, shapes[1][0])

    def reduction(self, shapes: tuple[Shape, ...], attrs: Attrs) -> int:
        return shapes[0][-1]

    def weights(self, operands: list[np.ndarray], attrs: Attrs) -> np.ndarray:
        """W[n, k] (float64) from the block arrays."""
        layout = self.layout(attrs)
        scales, quants = operands[1], operands[-2] if dict(attrs)["bias"] else operands[-1]
        n, blocks = scales.shape
        if layout.per_byte == 2:  # byte b * 16 + i: element b * 32 + i low, b * 32 + 16 + i high
            q = quants.astype(np.int64).reshape(n, blocks, HALF)
            q = np.concatenate([q & 15, q >> 4], axis=2).astype(np.float64)
        else:
            q = quants.astype(np.float64).reshape(n, blocks, BLOCK)
        w = scales[:, :, None] * q
        if layout.has_mins:
            w = w + operands[2][:, :, None]
        return w.reshape(n, blocks * BLOCK)

    def reference(self, operands: list[np.ndarray], attrs: Attrs) -> np.ndarray:
        out = operands[0][:, 0, :] @ self.weights(operands, attrs).T
        if dict(attrs)["bias"]:
            out = out + operands[-1]
        return out[:, None, :]

    def edge_shapes(self, shapes: tuple[Shape, ...], attrs: Attrs) -> tuple[Shape, ...]:
        n, k = self.EDGE
        layout = self.layout(attrs)
        blocks = (n, k // BLOCK)
        return ((self.ODD_ROWS, 1, k), blocks, *([blocks] if layout.has_mins else []), (n, k // layout.per_byte),
                *([(n,)] if dict(attrs)["bias"] else []))

    def variants(self, shapes: tuple[Shape, ...]) -> list[tuple[Shape, ...]]:
        return [((self.ODD_ROWS, *shapes[0][1:]), *shapes[1:])]

    def describe(self, shapes: tuple[Shape, ...], weight: bool) -> str:
        (_, _, k), (n, _) = shapes[:2]
        return f"rowsx1x{k} @ {n}x{k}^T"

    def describe_attrs(self, attrs: Attrs) -> list[str]:
        return [self.layout(attrs).name, *(["+bias"] if dict(attrs)["bias"] else [])]

    def input_sets(self, shapes: tuple[Shape, ...], attrs: Attrs,
                   rng: np.random.Generator) -> dict[str, list[np.ndarray]]:
        """Quants over their dtype's whole range; scales (and mins) of ordinary size with a zero
        and a negative one, tiny (float16 subnormals), large; x random, small integers (with
        scales powers of two: exact sums), zero."""
        layout = self.layout(attrs)
        info = np.iinfo(layout.quants_dtype)
        has_bias = bool(dict(attrs)["bias"])
        blocks = shapes[1]
        quants = rng.integers(info.min, info.max + 1, shapes[-2 if has_bias else -1]).astype(np.float64)
        bias = [rng.standard_normal(shapes[-1])] if has_bias else []

        def scale_arrays(size: float) -> list[np.ndarray]:
            arrays = [rng.standard_normal(blocks) * size for _ in range(2 if layout.has_mins else 1)]
            for a in arrays:
                a.flat[0], a.flat[-1] = 0.0, -abs(a.flat[-1])
            return [a.astype(np.float16).astype(np.float64) for a in arrays]

        def sets(x: np.ndarray, scales: list[np.ndarray]) -> list[np.ndarray]:
            return [x, *scales, quants, *bias]

        x = rng.standard_normal(shapes[0])
        powers = [2.0 ** rng.integers(-6, 3, blocks) * rng.choice([-1.0, 1.0], blocks)
                  for _ in range(2 if layout.has_mins else 1)]
        return {
            "random": sets(x, scale_arrays(0.02)),
            "tiny scales": sets(x, scale_arrays(1e-6)),
            "large scales": sets(x, scale_arrays(1e3)),
            "integers": sets(rng.integers(-4, 5, shapes[0]).astype(np.float64), powers),
            "zeros": sets(np.zeros(shapes[0]), scale_arrays(0.02)),
        }

    def error_scale_of(self, operands: list[np.ndarray], attrs: Attrs) -> float:
        return float((np.abs(operands[0][:, 0, :]) @ np.abs(self.weights(operands, attrs)).T).max(initial=0))

    def kernel_operands(self, shapes: tuple[Shape, ...], attrs: Attrs) -> list[tuple[str, Shape]]:
        layout = self.layout(attrs)
        names = ("x", "scales", *(("mins",) if layout.has_mins else ()), "quants", "bias")
        return [*zip(names, shapes), ("out", self.out_shape(shapes, attrs))]


OP_KINDS: dict[str, OpKind] = {kind.name: kind for kind in (Matmul(), Attention(), Conv2d(), BlockedConv2d(),
                                                             LayerNorm(), RMSNorm(), DequantGemv())}


def find_group(call: relax.Expr, mod: tvm.IRModule | None = None) -> tuple[OpKind, Group] | None:
    """The op kind and group `call` is, or None; `mod`: the module it is in (without it, kinds
    found by the function they call are not)."""
    for kind in OP_KINDS.values():
        group = kind.find_in(call, mod)
        if group is not None:
            return kind, group
    return None
