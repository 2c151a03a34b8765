"""Elementwise ops TVM converts wrongly or not at all: Elu, Celu, IsInf, Pow, Mod, Dropout;
and Clip, which TVM converts into TIR kernels at import.

Each follows ONNX's reference implementation (numpy) including its dtype rules and its
NaN/inf/signed-zero edge cases.
"""

from __future__ import annotations

import numpy as np
from tvm import relax

from ._common import OnnxOpConverter, const_value, dtype_of, optional_input, reject, scalar

_op = relax.op


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _elu(x: relax.Expr, alpha: float) -> relax.Expr:
    """x for x > 0, alpha * (exp(x) - 1) otherwise, in x's dtype."""
    dtype = dtype_of(x)
    negative = _op.multiply(scalar(alpha, dtype), _op.subtract(_op.exp(x), scalar(1, dtype)))
    return _op.where(_op.greater(x, scalar(0, dtype)), x, negative)


class Elu(OnnxOpConverter):
    """Elu in the input's dtype (TVM's converter adds float32 constants to any input)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        return _elu(inputs[0], float(attr.get("alpha", 1.0)))


class Celu(OnnxOpConverter):
    """Celu: alpha * Elu(x / alpha), in the input's dtype."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        x = inputs[0]
        alpha = scalar(float(attr.get("alpha", 1.0)), dtype_of(x))
        return _op.multiply(alpha, _elu(bb.emit(_op.divide(x, alpha)), 1.0))


class IsInf(OnnxOpConverter):
    """IsInf with detect_negative / detect_positive."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x = inputs[0]
        negative, positive = attr.get("detect_negative", 1), attr.get("detect_positive", 1)
        if not negative and not positive:
            return _op.zeros_like(x, "bool")
        inf = _op.isinf(x)
        if negative and positive:
            return inf
        zero = scalar(0, dtype_of(x))
        sign = _op.less(x, zero) if negative else _op.greater(x, zero)
        return _op.logical_and(inf, sign)


def _numpy_dtype(dtype: str) -> np.dtype | None:
    try:
        return np.dtype(dtype)
    except TypeError:
        return None


class Pow(OnnxOpConverter):
    """Pow as the reference (numpy) computes it, cast to the base's dtype: float ** float or
    int in numpy's promoted float dtype, int ** float in float64. int ** int is refused
    (TVM has no integer power; float64 would round results over 2**53)."""

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        base, exponent = inputs
        dtype, exp_dtype = dtype_of(base), dtype_of(exponent)
        if not _is_float(dtype) and not _is_float(exp_dtype):
            raise reject(cls.__name__, f"integer base and exponent ({dtype}, {exp_dtype})")
        if dtype == exp_dtype:
            return _op.power(base, exponent)
        a, b = _numpy_dtype(dtype), _numpy_dtype(exp_dtype)
        compute = np.result_type(a, b).name if a is not None and b is not None else "float32"
        if not _is_float(compute):
            raise reject(cls.__name__, f"{dtype} base and {exp_dtype} exponent")
        value = _op.power(_op.astype(base, compute), _op.astype(exponent, compute))
        return _op.astype(value, dtype)


class Mod(OnnxOpConverter):
    """Mod-10+: fmod=1 is C fmod, fmod=0 numpy's mod (the result takes the divisor's sign,
    a zero result is a zero of the divisor's sign); integers as TVM does (truncating /
    flooring)."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        a, b = inputs
        dtype = dtype_of(a)
        fmod = attr.get("fmod", 0)
        if not _is_float(dtype):
            return _op.mod(a, b) if fmod else _op.floor_mod(a, b)
        rem = bb.emit(_op.mod(a, b))  # C fmod (checked on NaN/inf/signed-zero cases)
        if fmod:
            return rem
        zero = scalar(0, dtype)
        signs_differ = _op.logical_xor(_op.less(rem, zero), _op.less(b, zero))
        adjust = _op.logical_and(_op.not_equal(rem, zero), signs_differ)
        rem = bb.emit(_op.where(adjust, _op.add(rem, b), rem))
        signed_zero = _op.where(_op.less(b, zero), scalar(-0.0, dtype), zero)
        return _op.where(_op.equal(rem, zero), signed_zero, rem)


class Dropout(OnnxOpConverter):
    """Dropout in inference: the input, and an all-true mask. Training mode with a nonzero
    ratio (random) is refused, as is a training_mode input known only at run time."""

    @classmethod
    def _outputs(cls, x: relax.Expr, attr: dict) -> relax.Expr:
        if attr["tvm_custom"]["num_outputs"] == 1:
            return x
        return relax.Tuple([x, _op.ones_like(x, "bool")])

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        if not attr.get("is_test", 0) and attr.get("ratio", 0.5) != 0:
            raise reject(cls.__name__, "is_test=0 (training) and a nonzero ratio")
        return cls._outputs(inputs[0], attr)

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        return cls._outputs(inputs[0], attr)

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        training = optional_input(inputs, 2)
        if training is not None:
            training_value = const_value(training)
            if training_value is None:
                raise reject(cls.__name__, "a run-time training_mode input")
            if training_value:
                ratio = optional_input(inputs, 1)
                ratio_value = 0.5 if ratio is None else const_value(ratio)
                if ratio_value is None or ratio_value != 0:
                    raise reject(cls.__name__, "training_mode=1 and a nonzero ratio (random)")
        return cls._outputs(inputs[0], attr)


def _clip_bound(bb: relax.BlockBuilder, bound: relax.Expr, unbounded: float) -> relax.Expr:
    """A Clip bound with NaN read as no bound (ONNX, onnxruntime): a constant is replaced
    at import, a run-time bound through `where`."""
    if not _is_float(dtype_of(bound)):
        return bound
    value = const_value(bound)
    if value is None:
        return bb.emit(_op.where(_op.isnan(bound), scalar(unbounded, dtype_of(bound)), bound))
    return relax.const(np.where(np.isnan(value), unbounded, value).astype(value.dtype), dtype_of(bound))


class Clip(OnnxOpConverter):
    """Clip as Relax `maximum` with the lower bound, then `minimum` with the upper one: the
    same kernels as TVM's converter, which writes them as TIR at import (`emit_te`), where the
    CPU library's epilogue fusion (`relax_passes.dispatch_cpu_library`) cannot see them."""

    @staticmethod
    def _clip(bb: relax.BlockBuilder, x: relax.Expr, lo: relax.Expr | None,
              hi: relax.Expr | None) -> relax.Expr:
        if lo is not None:
            x = bb.emit(_op.maximum(x, _clip_bound(bb, lo, -np.inf)))
        if hi is not None:
            x = _op.minimum(x, _clip_bound(bb, hi, np.inf))
        return x

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        dtype = dtype_of(inputs[0])
        bounds = [scalar(float(attr[name]), dtype) if name in attr else None for name in ("min", "max")]
        return cls._clip(bb, inputs[0], *bounds)

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        return cls._clip(bb, inputs[0], optional_input(inputs, 1), optional_input(inputs, 2))
