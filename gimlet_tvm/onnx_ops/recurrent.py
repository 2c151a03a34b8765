"""RNN, GRU and LSTM, unrolled over a sequence length known at import time.

Every attribute of opsets 7-22 is handled: direction (forward, reverse, bidirectional),
layout (time- or batch-major), activations with their alpha/beta, clip, GRU's
linear_before_reset, LSTM's input_forget and peepholes, and optional B, initial_h/initial_c
and sequence_lens (constant or run-time: a batch entry keeps its state and outputs zeros past
its length, and a reverse pass starts at its last valid step). The batch size may be symbolic.
Refused: a sequence length unknown at import time, an unknown activation.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import tvm
from tvm import relax

from ._common import (OnnxOpConverter, as_text, const, const_value, dtype_of, optional_input,
                      reject, scalar, text_attr)

_op = relax.op
Activation = Callable[[relax.Expr], relax.Expr]

# Activations taking alpha / beta; values are consumed in order by the functions using them.
_DEFAULT_ALPHA = {"affine": 1.0, "leakyrelu": 0.01, "thresholdedrelu": 1.0, "scaledtanh": 1.0,
                  "hardsigmoid": 0.2, "elu": 1.0}
_DEFAULT_BETA = {"affine": 0.0, "scaledtanh": 1.0, "hardsigmoid": 0.5}




def _activation(op: str, name: str, alpha: float, beta: float, dtype: str) -> Activation:
    """The ONNX RNN activation `name` (case-insensitive) as a function of a Relax tensor."""
    a, b = scalar(alpha, dtype), scalar(beta, dtype)
    one, zero = scalar(1, dtype), scalar(0, dtype)
    functions: dict[str, Activation] = {
        "relu": _op.nn.relu,
        "tanh": _op.tanh,
        "sigmoid": _op.sigmoid,
        "affine": lambda x: _op.add(_op.multiply(a, x), b),
        "leakyrelu": lambda x: _op.nn.leakyrelu(x, alpha),
        "thresholdedrelu": lambda x: _op.where(_op.greater(x, a), x, zero),
        "scaledtanh": lambda x: _op.multiply(a, _op.tanh(_op.multiply(b, x))),
        "hardsigmoid": lambda x: _op.clip(_op.add(_op.multiply(a, x), b), 0, 1),
        "elu": lambda x: _op.where(_op.less(x, zero),
                                   _op.multiply(a, _op.subtract(_op.exp(x), one)), x),
        "softsign": lambda x: _op.divide(x, _op.add(one, _op.abs(x))),
        "softplus": lambda x: _op.log(_op.add(one, _op.exp(x))),
    }
    if name.lower() not in functions:
        raise reject(op, f"activation {name}")
    return functions[name.lower()]


def _activations(op: str, attr: dict, defaults: Sequence[str], directions: int,
                 dtype: str) -> list[list[Activation]]:
    """Per direction, the activation functions (f, g[, h]) from the attributes."""
    names = [as_text(n) for n in attr.get("activations", defaults)]
    if len(names) == len(defaults) and directions == 2:
        names = names * 2
    if len(names) != len(defaults) * directions:
        raise reject(op, f"{len(names)} activations for {directions} direction(s)")
    alphas = list(attr.get("activation_alpha", ()))
    betas = list(attr.get("activation_beta", ()))
    functions = []
    for name in names:
        key = name.lower()
        alpha = alphas.pop(0) if key in _DEFAULT_ALPHA and alphas else _DEFAULT_ALPHA.get(key, 0.0)
        beta = betas.pop(0) if key in _DEFAULT_BETA and betas else _DEFAULT_BETA.get(key, 0.0)
        functions.append(_activation(op, name, alpha, beta, dtype))
    n = len(defaults)
    return [functions[d * n:(d + 1) * n] for d in range(directions)]


class _Recurrent(OnnxOpConverter):
    """The shared driver: per direction, input projections for all steps at once, then one
    `_cell` per time step. Subclasses give the gate count, default activations and the cell."""

    gates = 1
    default_activations: tuple[str, ...] = ()

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        op = cls.__name__
        x, w, r = inputs[0], inputs[1], inputs[2]
        dtype = dtype_of(x)
        batch_major = attr.get("layout", 0) == 1
        direction = text_attr(attr, "direction", "forward")
        if direction not in ("forward", "reverse", "bidirectional"):
            raise reject(op, f"direction={direction}")
        directions = 2 if direction == "bidirectional" else 1
        states = [optional_input(inputs, k) for k in range(5, 7 if cls.gates == 4 else 6)]
        if batch_major:
            x = bb.emit(_op.permute_dims(x, [1, 0, 2]))
            states = [None if s is None else bb.emit(_op.permute_dims(s, [1, 0, 2]))
                      for s in states]
        steps, batch, _ = x.ty.shape.values if x.ty.shape is not None else (None,) * 3
        if not isinstance(steps, tvm.tirx.IntImm):
            raise reject(op, "a sequence length unknown at import time")
        steps = int(steps)
        hidden = int(attr.get("hidden_size", 0)) or int(r.ty.shape.values[-1])
        activations = _activations(op, attr, cls.default_activations, directions, dtype)
        masks = _masks(bb, optional_input(inputs, 4), steps)
        clip = attr.get("clip")
        bias = optional_input(inputs, 3)
        peepholes = optional_input(inputs, 7) if cls.gates == 4 else None
        zeros = bb.emit(_op.zeros(relax.ShapeExpr([batch, hidden]), dtype))

        outputs, finals = [], []
        for d in range(directions):
            def pick(t, _d=d):
                return None if t is None else bb.emit(_op.take(t, const(np.int64(_d)), axis=0))

            projections, rb_h = _input_projections(bb, x, pick(w), pick(bias), cls.gates,
                                                   hidden, steps)
            weights = dict(r=pick(r), rb_h=rb_h, p=pick(peepholes), act=activations[d],
                           clip=clip, hidden=hidden, attr=attr)
            state = [pick(s) if s is not None else zeros for s in states]
            backward = direction == "reverse" or d == 1
            ys = [None] * steps
            for t in (reversed(range(steps)) if backward else range(steps)):
                new = cls._cell(bb, projections[t], state, weights)
                if masks is None:
                    state, ys[t] = new, new[0]
                else:
                    state = [bb.emit(_op.where(masks[t], n, s)) for n, s in zip(new, state)]
                    ys[t] = bb.emit(_op.where(masks[t], new[0], _op.zeros_like(new[0])))
            outputs.append(bb.emit(_op.stack(ys, axis=0)))
            finals.append(state)

        y = bb.emit(_op.stack(outputs, axis=1))  # (steps, directions, batch, hidden)
        results = [y] + [bb.emit(_op.stack([f[k] for f in finals], axis=0))
                         for k in range(len(states))]
        if batch_major:
            results = [bb.emit(_op.permute_dims(results[0], [2, 0, 1, 3]))] + [
                bb.emit(_op.permute_dims(s, [1, 0, 2])) for s in results[1:]]
        return relax.Tuple(results)

    @classmethod
    def _cell(cls, bb: relax.BlockBuilder, x_proj: relax.Expr, state: list, weights: dict) -> list:
        raise NotImplementedError


def _masks(bb: relax.BlockBuilder, lengths: relax.Expr | None,
           steps: int) -> list[relax.Expr] | None:
    """Per time step, a (batch, 1) bool tensor `t < sequence_lens`; None when every length is
    known to be the full sequence."""
    if lengths is None:
        return None
    value = const_value(lengths)
    if value is not None and np.all(value == steps):
        return None
    lengths = bb.emit(_op.expand_dims(_op.astype(lengths, "int64"), 1))
    return [bb.emit(_op.less(scalar(t, "int64"), lengths)) for t in range(steps)]


def _input_projections(bb: relax.BlockBuilder, x: relax.Expr, w: relax.Expr,
                       bias: relax.Expr | None, gates: int, hidden: int,
                       steps: int) -> tuple[list[relax.Expr], relax.Expr | None]:
    """x W^T + Wb + Rb for every step, as `steps` (batch, gates*hidden) tensors. GRU's h gate
    leaves its recurrent bias out: it goes inside the reset product and is returned apart."""
    proj = _op.matmul(x, _op.permute_dims(w))
    rb_h = None
    if bias is not None:
        w_bias, r_bias = _parts(bb, bias, 2)
        if gates == 3:
            r_zr, rb_h = _parts(bb, r_bias, [2 * hidden])
            r_bias = _op.concat([r_zr, _op.zeros_like(rb_h)])
        proj = _op.add(proj, _op.add(w_bias, r_bias))
    steps_proj = _parts(bb, bb.emit(proj), steps, axis=0)
    return [bb.emit(_op.squeeze(p, [0])) for p in steps_proj], rb_h


def _recurrent(h: relax.Expr, r: relax.Expr) -> relax.Expr:
    return _op.matmul(h, _op.permute_dims(r))


def _clipped(value: relax.Expr, clip: float | None) -> relax.Expr:
    return value if clip is None else _op.clip(value, -clip, clip)


def _parts(bb: relax.BlockBuilder, value: relax.Expr, sections: int | list[int],
           axis: int = -1) -> list[relax.Expr]:
    """`value` split along `axis` (into `sections` equal parts, or at the given indices)."""
    count = sections if isinstance(sections, int) else len(sections) + 1
    if count == 1:
        return [value]
    parts = bb.emit(_op.split(value, sections, axis=axis))
    return [bb.emit(relax.TupleGetItem(parts, k)) for k in range(count)]


class RNN(_Recurrent):
    """RNN-7/14/22: H = f(x W^T + H R^T + Wb + Rb)."""

    default_activations = ("Tanh",)

    @classmethod
    def _cell(cls, bb, x_proj, state, weights):
        (f,) = weights["act"]
        gates = _clipped(_op.add(x_proj, _recurrent(state[0], weights["r"])), weights["clip"])
        return [bb.emit(f(gates))]


class GRU(_Recurrent):
    """GRU-7/14/22 with gates z, r, h and linear_before_reset."""

    gates = 3
    default_activations = ("Sigmoid", "Tanh")

    @classmethod
    def _cell(cls, bb, x_proj, state, weights):
        f, g = weights["act"]
        (h,) = state
        hidden, clip = weights["hidden"], weights["clip"]
        r_zr, r_h = _parts(bb, weights["r"], [2 * hidden], axis=0)
        x_zr, x_h = _parts(bb, x_proj, [2 * hidden])
        z, r = _parts(bb, bb.emit(f(_clipped(_op.add(x_zr, _recurrent(h, r_zr)), clip))), 2)
        rb_h = weights["rb_h"]
        if weights["attr"].get("linear_before_reset", 0):
            recurrent = _recurrent(h, r_h)
            if rb_h is not None:
                recurrent = _op.add(recurrent, rb_h)
            recurrent = _op.multiply(r, recurrent)
        else:
            recurrent = _recurrent(_op.multiply(r, h), r_h)
            if rb_h is not None:
                recurrent = _op.add(recurrent, rb_h)
        candidate = bb.emit(g(_clipped(_op.add(x_h, recurrent), clip)))
        one = scalar(1, dtype_of(h))
        return [bb.emit(_op.add(_op.multiply(_op.subtract(one, z), candidate),
                                _op.multiply(z, h)))]


class LSTM(_Recurrent):
    """LSTM-7/14/22 with gates i, o, f, c, peepholes P (i, o, f) and input_forget."""

    gates = 4
    default_activations = ("Sigmoid", "Tanh", "Tanh")

    @classmethod
    def _cell(cls, bb, x_proj, state, weights):
        f, g, h_act = weights["act"]
        h, c = state
        clip = weights["clip"]
        gi, go, gf, gc = _parts(bb, bb.emit(_op.add(x_proj, _recurrent(h, weights["r"]))), 4)
        pi = po = pf = None
        if weights["p"] is not None:
            pi, po, pf = _parts(bb, weights["p"], 3)
        i = bb.emit(f(_clipped(gi if pi is None else _op.add(gi, _op.multiply(pi, c)), clip)))
        if weights["attr"].get("input_forget", 0):
            forget = bb.emit(_op.subtract(scalar(1, dtype_of(h)), i))
        else:
            forget = bb.emit(f(_clipped(gf if pf is None else _op.add(gf, _op.multiply(pf, c)),
                                        clip)))
        cell = bb.emit(_op.add(_op.multiply(forget, c), _op.multiply(i, g(_clipped(gc, clip)))))
        o = bb.emit(f(_clipped(go if po is None else _op.add(go, _op.multiply(po, cell)), clip)))
        return [bb.emit(_op.multiply(o, h_act(cell))), cell]
