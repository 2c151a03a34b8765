"""Attention (opset 23/24): 3-D or 4-D inputs, masks, KV cache, GQA, softcap, windows;
LinearAttention (opset 27); ai.onnx.preview FlexAttention."""

from __future__ import annotations

import numpy as np
import onnx
from tvm import relax

from ._common import (OnnxOpConverter, OpsetConverter, const, dtype_of, optional_input, reject,
                      scalar, static_shape, text_attr)
from .control import convert_graph

_op = relax.op


def _split_heads(bb: relax.BlockBuilder, x: relax.Expr, heads: int) -> relax.Expr:
    """(batch, seq, heads * size) -> (batch, heads, seq, size)."""
    batch, seq, hidden = static_shape(x)
    x = bb.emit(_op.reshape(x, (batch, seq, heads, hidden // heads)))
    return bb.emit(_op.permute_dims(x, [0, 2, 1, 3]))


def _is_neg_inf(bb: relax.BlockBuilder, x: relax.Expr) -> relax.Expr:
    """x == -inf, tested in float32 (finiteness ops have no bfloat16 kernels)."""
    x = bb.emit(_op.astype(x, "float32"))
    return bb.emit(_op.logical_and(_op.isinf(x), _op.less(x, scalar(0, "float32"))))


def _safe_softmax(bb: relax.BlockBuilder, x: relax.Expr) -> relax.Expr:
    """Softmax over the last axis that gives 0 (not NaN) for rows that are all -inf."""
    dtype = dtype_of(x)
    row_max = bb.emit(_op.max(x, axis=[-1], keepdims=True))
    row_max = bb.emit(_op.where(_is_neg_inf(bb, row_max), scalar(0, dtype), row_max))
    exp = bb.emit(_op.exp(_op.subtract(x, row_max)))
    total = bb.emit(_op.sum(exp, axis=[-1], keepdims=True))
    total = bb.emit(_op.where(_op.equal(total, scalar(0, dtype)), scalar(1, dtype), total))
    return bb.emit(_op.divide(exp, total))


class Attention(OnnxOpConverter):
    """Follows the ONNX reference implementation step by step (scale split over Q and K)."""

    @classmethod
    def _impl_v23(cls, bb, inputs, attr, params):
        q, k, v = inputs[0], inputs[1], inputs[2]
        mask, past_key, past_value = (optional_input(inputs, i) for i in (3, 4, 5))
        nonpad = optional_input(inputs, 6)
        if any(static_shape(x) is None for x in (q, k, v)):
            raise reject("Attention", "dynamic input shapes")
        out_dtype = dtype_of(q)
        # Half-precision inputs are computed in float32 (as onnxruntime does) and cast back.
        dtype = "float32" if out_dtype in ("float16", "bfloat16") else out_dtype
        rank = len(static_shape(q))
        if rank == 3:
            if "q_num_heads" not in attr or "kv_num_heads" not in attr:
                raise reject("Attention", "3-D inputs without q_num_heads/kv_num_heads")
            q = _split_heads(bb, q, attr["q_num_heads"])
            k = _split_heads(bb, k, attr["kv_num_heads"])
            v = _split_heads(bb, v, attr["kv_num_heads"])
        q_len, head_size = static_shape(q)[2], static_shape(q)[3]
        scale = attr.get("scale", 1.0 / np.sqrt(head_size))
        scale_sqrt = scalar(np.sqrt(scale), "float32")
        if past_key is not None:
            k = bb.emit(_op.concat([past_key, k], axis=2))
            v = bb.emit(_op.concat([past_value, v], axis=2))
        present_key, present_value = k, v
        if dtype != out_dtype:
            q, k, v = (bb.emit(_op.astype(x, dtype)) for x in (q, k, v))
            if mask is not None and dtype_of(mask) != "bool":
                mask = bb.emit(_op.astype(mask, dtype))
        kv_len = static_shape(k)[2]
        past_len = static_shape(past_key)[2] if past_key is not None else None

        bias = cls._bias(bb, attr, mask, nonpad, dtype, q_len, kv_len, past_len)

        q_heads, kv_heads = static_shape(q)[1], static_shape(k)[1]
        if q_heads != kv_heads:
            if q_heads % kv_heads:
                raise reject("Attention", f"{q_heads} query heads over {kv_heads} KV heads")
            k = bb.emit(_op.repeat(k, q_heads // kv_heads, axis=1))
            v = bb.emit(_op.repeat(v, q_heads // kv_heads, axis=1))
        sqrt_scale = bb.emit(_op.astype(scale_sqrt, dtype))
        scores = bb.emit(_op.matmul(_op.multiply(q, sqrt_scale),
                                    _op.permute_dims(_op.multiply(k, sqrt_scale), [0, 1, 3, 2])))
        softcap = attr.get("softcap", 0.0)
        if softcap > 0:
            cap = scalar(softcap, dtype)
            scores = bb.emit(_op.multiply(_op.tanh(_op.divide(scores, cap)), cap))
        biased = bb.emit(_op.add(scores, bias)) if bias is not None else scores
        mode = attr.get("qk_matmul_output_mode", 0)
        qk_output = biased if mode == 2 else scores

        precision = attr.get("softmax_precision")
        probs = biased
        if precision is not None:
            probs = bb.emit(_op.astype(probs, onnx.helper.tensor_dtype_to_np_dtype(precision).name))
        probs = _safe_softmax(bb, probs)
        if bias is not None:
            bias_max = bb.emit(_op.max(bias, axis=[-1], keepdims=True))
            probs = bb.emit(_op.where(_is_neg_inf(bb, bias_max), scalar(0, dtype_of(probs)), probs))
        probs = bb.emit(_op.astype(probs, dtype))
        if mode == 3:
            qk_output = probs
        out = bb.emit(_op.astype(_op.matmul(probs, v), out_dtype))
        qk_output = bb.emit(_op.astype(qk_output, out_dtype))
        if rank == 3:
            batch, heads, seq, size = static_shape(out)
            out = bb.emit(_op.reshape(_op.permute_dims(out, [0, 2, 1, 3]),
                                      (batch, seq, heads * size)))
        results = [out, present_key, present_value, qk_output]
        return relax.Tuple(results[: attr["tvm_custom"]["num_outputs"]])

    @classmethod
    def _bias(cls, bb, attr, mask, nonpad, dtype, q_len, kv_len, past_len):
        """The additive bias (mask, causal, window, padding), or None when there is none."""
        neg_inf, zero = scalar(-np.inf, dtype), scalar(0, dtype)
        bias = None
        if mask is not None:
            mask_shape = static_shape(mask)
            pad = kv_len - mask_shape[-1]
            if pad > 0:
                fill = np.zeros(mask_shape[:-1] + [pad], "bool")
                if dtype_of(mask) != "bool":
                    fill = _op.astype(const(fill - np.float32(np.inf)), dtype_of(mask))
                filler = bb.emit(const(fill) if isinstance(fill, np.ndarray) else fill)
                mask = bb.emit(_op.concat([mask, filler], axis=-1))
            if dtype_of(mask) == "bool":
                mask = bb.emit(_op.where(mask, zero, neg_inf))
            bias = mask
        rows = np.arange(q_len).reshape(q_len, 1)
        cols = np.arange(kv_len).reshape(1, kv_len)
        # offset: where query i sits among the keys; per batch with an external cache.
        if nonpad is not None:
            lengths = bb.emit(_op.astype(nonpad, "int64"))
            lengths = bb.emit(_op.reshape(lengths, (-1, 1, 1, 1)))
        if nonpad is not None and past_len is None:
            offset = bb.emit(_op.subtract(lengths, scalar(q_len, "int64")))
            diff = bb.emit(_op.subtract(_op.add(const(rows), offset), const(cols)))
        else:
            diff = const(rows + (past_len or 0) - cols)
        allowed = []
        if attr.get("is_causal", 0):
            allowed.append(_op.greater_equal(diff, scalar(0, "int64")))
        left, right = attr.get("left_window_size", -1), attr.get("right_window_size", -1)
        if left >= 0:
            allowed.append(_op.less_equal(diff, scalar(left, "int64")))
        if right >= 0:
            allowed.append(_op.greater_equal(diff, scalar(-right, "int64")))
        if nonpad is not None:
            allowed.append(_op.less(const(cols), lengths))
        for condition in allowed:
            term = bb.emit(_op.where(condition, zero, neg_inf))
            bias = term if bias is None else bb.emit(_op.add(bias, term))
        return bias


def _heads_first(bb: relax.BlockBuilder, x: relax.Expr, heads: int) -> relax.Expr:
    """(batch, seq, heads * size) -> (batch, heads, seq, size), in float32."""
    return bb.emit(_op.astype(_split_heads(bb, x, heads), "float32"))


def _step(bb: relax.BlockBuilder, x: relax.Expr, t: int) -> relax.Expr:
    """x[:, :, t:t+1] of a (batch, heads, seq, size) tensor."""
    return bb.emit(_op.strided_slice(x, [2], [t], [t + 1]))


class LinearAttention(OnnxOpConverter):
    """Linear attention (update_rule linear, gated, delta, gated_delta) with GQA, past state,
    per-head or per-key-dim decay and per-head or shared beta, run as the ONNX reference does:
    the recurrence unrolled over the (static) sequence, in float32, outputs cast back.

    Refuses inputs of run-time shape and decay/beta shapes the spec does not allow."""

    @classmethod
    def _impl_v27(cls, bb, inputs, attr, params):
        q, k, v = inputs[0], inputs[1], inputs[2]
        past, decay, beta = (optional_input(inputs, i) for i in (3, 4, 5))
        rule = text_attr(attr, "update_rule", "gated_delta")
        gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
        if rule not in ("linear", "gated", "delta", "gated_delta"):
            raise reject("LinearAttention", f"update_rule '{rule}'")
        if gated != (decay is not None) or delta != (beta is not None):
            raise reject("LinearAttention", f"update_rule '{rule}' with these decay/beta inputs")
        q_heads, kv_heads = attr.get("q_num_heads", 0), attr.get("kv_num_heads", 0)
        if kv_heads <= 0 or q_heads <= 0 or q_heads % kv_heads:
            raise reject("LinearAttention", f"q_num_heads={q_heads}, kv_num_heads={kv_heads}")
        tensors = [x for x in (q, k, v, past, decay, beta) if x is not None]
        if any(static_shape(x) is None for x in tensors):
            raise reject("LinearAttention", "inputs of run-time shape")
        batch, seq, _ = static_shape(q)
        d_k, d_v = static_shape(k)[2] // kv_heads, static_shape(v)[2] // kv_heads
        q4, k4, v4 = (_heads_first(bb, x, n) for x, n in ((q, q_heads), (k, kv_heads),
                                                           (v, kv_heads)))
        if gated:
            width = static_shape(decay)[2]
            if width not in (kv_heads, kv_heads * d_k):
                raise reject("LinearAttention", f"decay of last dim {width}")
            # exp(decay) as (batch, kv heads, seq, 1 or d_k)
            decay = bb.emit(_op.exp(_heads_first(bb, decay, kv_heads)))
        if delta:
            width = static_shape(beta)[2]
            if width not in (kv_heads, 1):
                raise reject("LinearAttention", f"beta of last dim {width}")
            beta = _heads_first(bb, beta, width)
        state_dtype = dtype_of(past) if past is not None else dtype_of(q)
        if past is None:
            state = bb.emit(_op.zeros((batch, kv_heads, d_k, d_v), "float32"))
        else:
            state = bb.emit(_op.astype(past, "float32"))
        scale = attr.get("scale", 0.0) or 1.0 / np.sqrt(d_k)
        outputs = []
        for t in range(seq):
            k_t, v_t = _step(bb, k4, t), _step(bb, v4, t)
            if gated:
                state = bb.emit(_op.multiply(state, _op.permute_dims(_step(bb, decay, t),
                                                                     [0, 1, 3, 2])))
            if delta:
                retrieved = _op.matmul(k_t, state)
                v_t = bb.emit(_op.multiply(_step(bb, beta, t), _op.subtract(v_t, retrieved)))
            state = bb.emit(_op.add(state, _op.multiply(_op.permute_dims(k_t, [0, 1, 3, 2]), v_t)))
            read = state if q_heads == kv_heads else _op.repeat(state, q_heads // kv_heads, axis=1)
            outputs.append(bb.emit(_op.matmul(_step(bb, q4, t), read)))
        out = bb.emit(_op.multiply(_op.concat(outputs, axis=2), scalar(scale, "float32")))
        out = bb.emit(_op.reshape(_op.permute_dims(out, [0, 2, 1, 3]), (batch, seq, q_heads * d_v)))
        return relax.Tuple([bb.emit(_op.astype(out, dtype_of(q))),
                            bb.emit(_op.astype(state, state_dtype))])


def _rounded_matmul(bb: relax.BlockBuilder, a: relax.Expr, b: relax.Expr) -> relax.Expr:
    """a @ b in a's dtype; half-precision products summed in float32 and rounded once."""
    dtype = dtype_of(a)
    if dtype not in ("float16", "bfloat16"):
        return bb.emit(_op.matmul(a, b))
    return bb.emit(_op.astype(_op.matmul(a, b, out_dtype="float32"), dtype))


class FlexAttention(OpsetConverter):
    """ai.onnx.preview FlexAttention: rank-4 Q/K/V, GQA, scale, score_mod and prob_mod
    subgraphs converted inline, softmax in float32 (float64 for double inputs) or
    `softmax_precision`, as the ONNX reference computes it.

    Refuses inputs of run-time shape and a half-precision softmax_precision."""

    domain = "ai.onnx.preview"

    @classmethod
    def _convert(cls, bb, inputs, attr, params, opset):
        q, k, v = inputs[0], inputs[1], inputs[2]
        if any(static_shape(x) is None or len(static_shape(x)) != 4 for x in (q, k, v)):
            raise reject("FlexAttention", "inputs of run-time shape or rank other than 4")
        dtype = dtype_of(q)
        q_heads, kv_heads = static_shape(q)[1], static_shape(k)[1]
        if q_heads % kv_heads:
            raise reject("FlexAttention", f"{q_heads} query heads over {kv_heads} KV heads")
        if q_heads != kv_heads:
            k, v = (bb.emit(_op.repeat(x, q_heads // kv_heads, axis=1)) for x in (k, v))
        if "softmax_precision" in attr:
            compute = onnx.helper.tensor_dtype_to_np_dtype(attr["softmax_precision"]).name
            if compute not in ("float32", "float64"):
                raise reject("FlexAttention", f"softmax_precision {compute}")
        else:
            compute = "float64" if dtype == "float64" else "float32"
        scale = attr.get("scale", 1.0 / np.sqrt(static_shape(q)[3]))
        sqrt_scale = scalar(np.sqrt(np.float32(scale)), dtype)
        keys = bb.emit(_op.permute_dims(_op.multiply(k, sqrt_scale), [0, 1, 3, 2]))
        scores = _rounded_matmul(bb, bb.emit(_op.multiply(q, sqrt_scale)), keys)
        scores = bb.emit(_op.astype(scores, compute))

        def modified(name: str, x: relax.Expr) -> relax.Expr:
            if name not in attr:
                return x
            graph = attr[name]
            (out,) = convert_graph(bb, "FlexAttention", graph, {graph.input[0].name: x}, opset,
                                   params)
            return bb.emit(_op.astype(out, compute))

        scores = modified("score_mod", scores)
        exp = bb.emit(_op.exp(_op.subtract(scores, _op.max(scores, axis=[-1], keepdims=True))))
        probs = bb.emit(_op.divide(exp, _op.sum(exp, axis=[-1], keepdims=True)))
        probs = modified("prob_mod", probs)
        out = bb.emit(_op.matmul(probs, _op.astype(v, compute)))
        return bb.emit(_op.astype(out, dtype_of(v)))
