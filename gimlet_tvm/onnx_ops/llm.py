"""Ops of recent LLM architectures: Swish, SwiGLU, RotaryEmbedding, CausalConvWithState."""

from __future__ import annotations

from tvm import relax

from ._common import (OnnxOpConverter, dtype_of, optional_input, reject, scalar, static_shape,
                      text_attr)

_op = relax.op
_HALF = ("float16", "bfloat16")


def _widened(bb: relax.BlockBuilder, x: relax.Expr) -> relax.Expr:
    """float16/bfloat16 `x` as float32 (other dtypes as they are)."""
    return bb.emit(_op.astype(x, "float32")) if dtype_of(x) in _HALF else x


def _swish(bb: relax.BlockBuilder, x: relax.Expr, alpha: float) -> relax.Expr:
    """x * sigmoid(alpha * x) in x's dtype."""
    scaled = bb.emit(_op.multiply(x, scalar(alpha, dtype_of(x)))) if alpha != 1.0 else x
    return bb.emit(_op.multiply(x, _op.sigmoid(scaled)))


class Swish(OnnxOpConverter):
    """x * sigmoid(alpha * x) for float inputs; float16/bfloat16 computed in float32 and
    rounded once (op by op in float16 lands up to 2 steps off the ONNX reference)."""

    @classmethod
    def _impl_v24(cls, bb, inputs, attr, params):
        x = inputs[0]
        y = _swish(bb, _widened(bb, x), attr.get("alpha", 1.0))
        return bb.emit(_op.astype(y, dtype_of(x)))


class SwiGLU(OnnxOpConverter):
    """Swish_alpha(A) * B; A and B of the same shape and dtype, half precision as in Swish."""

    @classmethod
    def _impl_v28(cls, bb, inputs, attr, params):
        a, b = inputs
        y = _swish(bb, _widened(bb, a), attr.get("alpha", 1.0))
        y = bb.emit(_op.multiply(y, _widened(bb, b)))
        return bb.emit(_op.astype(y, dtype_of(a)))


class RotaryEmbedding(OnnxOpConverter):
    """Rotary position embedding of a 4-D (batch, heads, seq, head) or 3-D (batch, seq,
    heads * head) input, halves or interleaved pairs, on the first `rotary_embedding_dim`
    features; cos/sin taken at run-time `position_ids` or given per (batch, seq).

    Refuses inputs whose shape is not static."""

    @classmethod
    def _impl_v23(cls, bb, inputs, attr, params):
        x, cos, sin = inputs[0], inputs[1], inputs[2]
        position_ids = optional_input(inputs, 3)
        shape = static_shape(x)
        if shape is None or len(shape) not in (3, 4):
            raise reject("RotaryEmbedding", "an input of run-time shape or rank other than 3/4")
        if len(shape) == 4:
            batch, heads, seq, head = shape
            x = bb.emit(_op.permute_dims(x, [0, 2, 1, 3]))
        else:
            batch, seq, hidden = shape
            heads = attr.get("num_heads", 0)
            if heads <= 0 or hidden % heads:
                raise reject("RotaryEmbedding", f"3-D input of {hidden} features, num_heads={heads}")
            head = hidden // heads
            x = bb.emit(_op.reshape(x, (batch, seq, heads, head)))
        rotary = attr.get("rotary_embedding_dim", 0) or head
        if rotary > head or rotary % 2:
            raise reject("RotaryEmbedding", f"rotary_embedding_dim={rotary} for head size {head}")
        half = rotary // 2
        if position_ids is not None:
            cos, sin = (bb.emit(_op.take(c, position_ids, axis=0)) for c in (cos, sin))
        # (batch, seq, 1, half), broadcast over the heads
        cos, sin = (bb.emit(_op.expand_dims(c, 2)) for c in (cos, sin))
        x_rot = bb.emit(_op.strided_slice(x, axes=[3], begin=[0], end=[rotary]))
        if attr.get("interleaved", 0):
            pairs = bb.emit(_op.reshape(x_rot, (batch, seq, heads, half, 2)))
            x1, x2 = (bb.emit(_op.squeeze(_op.strided_slice(pairs, [4], [i], [i + 1]), [4]))
                      for i in (0, 1))
        else:
            halves = bb.emit(_op.split(x_rot, 2, axis=3))
            x1, x2 = bb.emit(relax.TupleGetItem(halves, 0)), bb.emit(relax.TupleGetItem(halves, 1))
        real = bb.emit(_op.subtract(_op.multiply(cos, x1), _op.multiply(sin, x2)))
        imag = bb.emit(_op.add(_op.multiply(sin, x1), _op.multiply(cos, x2)))
        if attr.get("interleaved", 0):
            rotated = bb.emit(_op.reshape(_op.stack([real, imag], axis=4),
                                          (batch, seq, heads, rotary)))
        else:
            rotated = bb.emit(_op.concat([real, imag], axis=3))
        if rotary < head:
            rest = bb.emit(_op.strided_slice(x, axes=[3], begin=[rotary], end=[head]))
            rotated = bb.emit(_op.concat([rotated, rest], axis=3))
        if len(shape) == 4:
            return bb.emit(_op.permute_dims(rotated, [0, 2, 1, 3]))
        return bb.emit(_op.reshape(rotated, shape))


class CausalConvWithState(OnnxOpConverter):
    """Causal depthwise 1-D convolution over (batch, channels, length) with a carried state of
    the last k - 1 positions, optional bias and fused SiLU/Swish.

    Written as a sum over the k taps of shifted slices times per-channel weights. As in the ONNX
    reference, float16/bfloat16 sums accumulate in float32 and are rounded once, the bias is
    added in the input dtype and the activation computed in float32. Refuses inputs of
    run-time shape and other activations."""

    @classmethod
    def _impl_v27(cls, bb, inputs, attr, params):
        x, weight = inputs[0], inputs[1]
        bias, past = optional_input(inputs, 2), optional_input(inputs, 3)
        activation = text_attr(attr, "activation", "none")
        if activation not in ("none", "silu", "swish"):
            raise reject("CausalConvWithState", f"activation '{activation}'")
        if static_shape(x) is None or static_shape(weight) is None:
            raise reject("CausalConvWithState", "inputs of run-time shape")
        batch, channels, length = static_shape(x)
        taps = static_shape(weight)[2]
        dtype = dtype_of(x)
        if past is None:
            past = _op.zeros((batch, channels, taps - 1), dtype)
        padded = bb.emit(_op.concat([past, x], axis=2))
        present = bb.emit(_op.strided_slice(padded, [2], [length], [length + taps - 1]))
        weight = _widened(bb, weight)
        out = None
        for tap in range(taps):
            window = _widened(bb, bb.emit(_op.strided_slice(padded, [2], [tap], [tap + length])))
            # weight[:, 0, tap] as (1, channels, 1)
            tap_weight = _op.reshape(_op.strided_slice(weight, [2], [tap], [tap + 1]),
                                     (1, channels, 1))
            term = _op.multiply(window, tap_weight)
            out = bb.emit(term if out is None else _op.add(out, term))
        out = bb.emit(_op.astype(out, dtype))
        if bias is not None:
            out = bb.emit(_op.add(out, _op.reshape(bias, (1, channels, 1))))
        if activation != "none":
            out = bb.emit(_op.astype(_swish(bb, _widened(bb, out), 1.0), dtype))
        return relax.Tuple([out, present])
