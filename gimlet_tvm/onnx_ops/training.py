"""The optimizer update ops of `ai.onnx.preview.training`: Adagrad, Adam and Momentum.

Each takes a learning rate R and step count T (scalars) and, for every one of N tensors, its
value X, gradient G and optimizer state (interleaved as X1..XN, G1..GN, states...), and returns
the updated values and states in the same grouping. Elementwise, in the tensors' dtype; the
branches on T (bias correction, first-step momentum) are `where`s, so T may be a run-time input.
"""

from __future__ import annotations

from typing import Callable, Sequence

from tvm import relax

from ._common import OnnxOpConverter, as_text, dtype_of, reject, scalar

_op = relax.op
_DOMAIN = "ai.onnx.preview.training"

Update = Callable[[relax.Expr, relax.Expr, list[relax.Expr]], list[relax.Expr]]
"""(rate, step, [X, G, state...] of one tensor) -> [new X, new state...]."""


def _per_tensor(name: str, inputs: Sequence[relax.Expr], states: int, update: Update) -> relax.Expr:
    """Applies `update` to each of the N tensors and groups the results as ONNX does."""
    rate, step, *groups = inputs
    per_tensor = 2 + states
    if len(groups) % per_tensor:
        raise reject(name, f"{len(inputs)} inputs (expected 2 + {per_tensor} x N)")
    count = len(groups) // per_tensor
    results = [update(rate, step, [groups[k * count + i] for k in range(per_tensor)])
               for i in range(count)]
    return relax.Tuple([result[k] for k in range(1 + states) for result in results])


def _regularized(x: relax.Expr, g: relax.Expr, attr: dict) -> relax.Expr:
    """G + norm_coefficient * X."""
    return _op.add(_op.multiply(scalar(attr.get("norm_coefficient", 0.0), dtype_of(x)), x), g)


def _as(value: relax.Expr, like: relax.Expr) -> relax.Expr:
    return _op.astype(value, dtype_of(like))


class Adagrad(OnnxOpConverter):
    """Adagrad-1: decay_factor, epsilon, norm_coefficient."""

    domain = _DOMAIN

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        def update(rate, step, tensors):
            x, g, h = tensors
            dtype = dtype_of(x)
            decay = _op.add(scalar(1.0, dtype), _op.multiply(_as(step, x), scalar(attr.get("decay_factor", 0.0), dtype)))
            g = _regularized(x, g, attr)
            h_new = bb.emit(_op.add(h, _op.multiply(g, g)))
            scale = _op.add(_op.sqrt(h_new), scalar(attr.get("epsilon", 0.0), dtype))
            x_new = _op.subtract(x, _op.divide(_op.multiply(_op.divide(_as(rate, x), decay), g), scale))
            return [bb.emit(x_new), h_new]

        return _per_tensor(cls.__name__, inputs, 1, update)


class Adam(OnnxOpConverter):
    """Adam-1: alpha, beta, epsilon, norm_coefficient, norm_coefficient_post; bias correction
    when T > 0."""

    domain = _DOMAIN

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        alpha, beta = attr.get("alpha", 0.9), attr.get("beta", 0.999)

        def update(rate, step, tensors):
            x, g, v, h = tensors
            dtype = dtype_of(x)
            g = bb.emit(_regularized(x, g, attr))
            v_new = bb.emit(_op.add(_op.multiply(scalar(alpha, dtype), v),
                                    _op.multiply(scalar(1 - alpha, dtype), g)))
            h_new = bb.emit(_op.add(_op.multiply(scalar(beta, dtype), h),
                                    _op.multiply(scalar(1 - beta, dtype), _op.multiply(g, g))))
            t, r = _as(step, x), _as(rate, x)
            one = scalar(1.0, dtype)
            corrected = _op.divide(
                _op.multiply(r, _op.sqrt(_op.subtract(one, _op.power(scalar(beta, dtype), t)))),
                _op.subtract(one, _op.power(scalar(alpha, dtype), t)))
            r = _op.where(_op.greater(step, scalar(0, dtype_of(step))), corrected, r)
            scale = _op.add(_op.sqrt(h_new), scalar(attr.get("epsilon", 0.0), dtype))
            x_new = _op.subtract(x, _op.multiply(r, _op.divide(v_new, scale)))
            post = scalar(1 - attr.get("norm_coefficient_post", 0.0), dtype)
            return [bb.emit(_op.multiply(post, x_new)), v_new, h_new]

        return _per_tensor(cls.__name__, inputs, 2, update)


class Momentum(OnnxOpConverter):
    """Momentum-1: standard and Nesterov modes; the gradient's coefficient is 1 at T = 0."""

    domain = _DOMAIN

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        mode = as_text(attr["mode"])
        if mode not in ("standard", "nesterov"):
            raise reject(cls.__name__, f"mode='{mode}'")

        def update(rate, step, tensors):
            x, g, v = tensors
            dtype = dtype_of(x)
            g = bb.emit(_regularized(x, g, attr))
            first = _op.greater(step, scalar(0, dtype_of(step)))
            coefficient = _op.where(first, scalar(attr["beta"], dtype), scalar(1.0, dtype))
            v_new = bb.emit(_op.add(_op.multiply(scalar(attr["alpha"], dtype), v),
                                    _op.multiply(coefficient, g)))
            direction = v_new if mode == "standard" else _op.add(
                g, _op.multiply(scalar(attr["alpha"], dtype), v_new))
            return [bb.emit(_op.subtract(x, _op.multiply(_as(rate, x), direction))), v_new]

        return _per_tensor(cls.__name__, inputs, 1, update)
