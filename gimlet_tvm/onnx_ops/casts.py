"""Cast, CastLike and BitCast, with float8/float4/e8m0 and 2-/4-bit integers.

Those dtypes live in the graph as carriers (`carried.py`): float formats as bit patterns in
uint8, small integers as values in int8/uint8. Decoding a float format is a lookup in its
table of values (exact in float32); encoding rounds to nearest even with exact float64
arithmetic and applies the format's overflow, NaN and signed-zero rules (ONNX's `saturate`;
e8m0 follows `round_mode`). Small integers wrap like ml_dtypes (truncation, then the low
bits). Other casts are TVM's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from tvm import relax, te, tirx
from tvm.relax.frontend.onnx import onnx_frontend

from ..carriers import FLOAT_BITS, SMALL_INTS, carrier, is_carried
from ._common import OnnxOpConverter, const, reject, text_attr
from .carried import dtype_name, input_dtypes


@dataclasses.dataclass(frozen=True)
class _Format:
    """A small float format: exponent/mantissa bits, bias, largest finite value and its code,
    the codes of NaN and of overflow without saturation, whether NaN keeps the sign and
    whether the format has a negative zero."""

    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_value: float
    max_code: int
    nan_code: int
    overflow_code: int
    signed_nan: bool
    negative_zero: bool

    @property
    def sign_bit(self) -> int:
        return 1 << (self.exponent_bits + self.mantissa_bits)

    @property
    def min_exponent(self) -> int:
        return 1 - self.bias

    @property
    def max_exponent(self) -> int:
        return int(np.floor(np.log2(self.max_value)))


_FORMATS = {
    "float8_e4m3fn": _Format(4, 3, 7, 448.0, 0x7E, 0x7F, 0x7F, True, True),
    "float8_e4m3fnuz": _Format(4, 3, 8, 240.0, 0x7F, 0x80, 0x80, False, False),
    "float8_e5m2": _Format(5, 2, 15, 57344.0, 0x7B, 0x7E, 0x7C, True, True),
    "float8_e5m2fnuz": _Format(5, 2, 16, 57344.0, 0x7F, 0x80, 0x80, False, False),
    # No NaN or infinity: NaN becomes 0, overflow saturates whatever `saturate` says.
    "float4_e2m1fn": _Format(2, 1, 1, 6.0, 0x7, 0x0, 0x7, False, True),
}
_E8M0 = "float8_e8m0fnu"


def _pow2(exponent: tirx.PrimExpr) -> tirx.PrimExpr:
    """2**exponent as float64, built from its bits (exponent in the normal range)."""
    return tirx.reinterpret("float64", (exponent + 1023).astype("int64") << 52)


def _exponent(value: tirx.PrimExpr) -> tirx.PrimExpr:
    """The unbiased binary exponent of a non-negative float64 (int32)."""
    return ((tirx.reinterpret("int64", value) >> 52) - 1023).astype("int32")


def _encode_scalar(x: tirx.PrimExpr, fmt: _Format, saturate: bool) -> tirx.PrimExpr:
    """The uint8 code of float64 `x` in `fmt`, rounded to nearest even."""
    m = fmt.mantissa_bits
    low, high = fmt.min_exponent, fmt.max_exponent
    negative = tirx.reinterpret("int64", x) < 0
    a = tirx.abs(x)
    # Round at the quantum of a's binade (the subnormal one below the normal range).
    quantum = _pow2(tirx.max(tirx.min(_exponent(a), high), low) - m)
    r = tirx.nearbyint(a / quantum) * quantum
    er = tirx.max(tirx.min(_exponent(r), high), low)
    subnormal = r < 2.0 ** low
    mantissa = tirx.Select(subnormal, (r / 2.0 ** (low - m)).astype("int32"),
                           (r / _pow2(er - m)).astype("int32") - (1 << m))
    magnitude = tirx.Select(subnormal, 0, (er + fmt.bias) << m) | mantissa
    overflow = fmt.max_code if saturate else fmt.overflow_code
    magnitude = tirx.Select(r > fmt.max_value, overflow, magnitude)
    signed = negative & ((magnitude != 0) | fmt.negative_zero)
    code = tirx.Select(signed, magnitude | fmt.sign_bit, magnitude)
    nan = tirx.Select(negative & fmt.signed_nan, fmt.nan_code | fmt.sign_bit, fmt.nan_code)
    return tirx.Select(tirx.isnan(x), nan, code).astype("uint8")


def _e8m0_scalar(x: tirx.PrimExpr, saturate: bool, round_mode: str) -> tirx.PrimExpr:
    """The e8m0 code of float32 `x` (onnx.numpy_helper.to_float8e8m0; the sign is dropped)."""
    bits = tirx.reinterpret("uint32", x)
    exponent = ((bits >> 23) & 0xFF).astype("int32")
    if round_mode == "nearest":
        guard = (bits & 0x400000) != 0
        rest = (bits & 0x3FFFFF) != 0
        up = guard & (rest | (exponent > 0))
    elif round_mode == "up":
        up = (bits & 0x7FFFFF) != 0
    else:  # "down"
        up = tirx.const(False)
    if saturate:
        up = up & (exponent != 0xFE)
    rounded = tirx.Select(up, exponent + 1, exponent)
    return tirx.Select(exponent == 0xFF, 0xFF, rounded).astype("uint8")


def _tvm_cast(bb: relax.BlockBuilder, x: relax.Expr, dtype: str) -> relax.Expr:
    """TVM's Cast of a non-carried value."""
    return onnx_frontend.Cast._impl_v13(bb, [x], {"to": dtype}, None)


def _decode(bb: relax.BlockBuilder, x: relax.Expr, dtype: str) -> relax.Expr:
    """A carried value as an ordinary one: float formats as float32, small ints as their
    carrier (which holds the value)."""
    if dtype in SMALL_INTS:
        return x
    # Indexed by every byte, so any carrier is in bounds (float4 reads the low 4 bits).
    codes = np.arange(256, dtype=np.uint8) & (0xFF if dtype.startswith("float8") else 0x0F)
    table = const(codes.view(dtype).astype(np.float32))
    return bb.emit(relax.op.take(table, relax.op.astype(x, "int32"), axis=0))


def _wrap_int(bb: relax.BlockBuilder, x: relax.Expr, source: str, dtype: str) -> relax.Expr:
    """`x` as `dtype` (int4/uint4/int2/uint2): truncated to an integer, then its low bits."""
    value = _tvm_cast(bb, x, "int64") if source.startswith(("float", "bfloat")) else \
        relax.op.astype(x, "int64")
    bits = int(dtype.lstrip("uint"))
    low = relax.op.bitwise_and(value, const(np.int64((1 << bits) - 1)))
    if dtype.startswith("int"):
        half = const(np.int64(1 << (bits - 1)))
        low = relax.op.subtract(relax.op.bitwise_xor(low, half), half)
    return bb.emit(relax.op.astype(low, carrier(dtype)))


def _encode_float(bb: relax.BlockBuilder, x: relax.Expr, source: str, dtype: str,
                  saturate: bool, round_mode: str) -> relax.Expr:
    """`x` (any ordinary dtype) as the bit pattern of float format `dtype`."""
    if dtype == _E8M0:
        x = bb.emit(relax.op.astype(x, "float32")) if source != "float32" else x
        return bb.emit_te(lambda t: te.compute(
            t.shape, lambda *i: _e8m0_scalar(t[i], saturate, round_mode), name="to_e8m0"), x)
    if not source.startswith(("float", "bfloat")):
        x = bb.emit(relax.op.astype(x, "float64"))  # exact for the integers that fit
    fmt = _FORMATS[dtype]
    return bb.emit_te(lambda t: te.compute(
        t.shape, lambda *i: _encode_scalar(t[i].astype("float64"), fmt, saturate),
        name=f"to_{dtype}"), x)


def cast(bb: relax.BlockBuilder, x: relax.Expr, source: str, dtype: str, saturate: bool = True,
         round_mode: str = "up") -> relax.Expr:
    """`x` of ONNX dtype `source` cast to `dtype`, carriers on either side."""
    if source == dtype:
        return x
    if is_carried(source):
        x = _decode(bb, x, source)
        source = "float32" if source in FLOAT_BITS else carrier(source)
    if not is_carried(dtype):
        return _tvm_cast(bb, x, dtype)
    if dtype in SMALL_INTS:
        return _wrap_int(bb, x, source, dtype)
    return _encode_float(bb, x, source, dtype, saturate, round_mode)


def _round_mode(op: str, attr: dict) -> str:
    mode = text_attr(attr, "round_mode", "up")
    if mode not in ("up", "nearest", "down"):
        raise reject(op, f"round_mode={mode}")
    return mode


def _convert(op: str, bb: relax.BlockBuilder, x: Any, source: str | None, dtype: str,
             attr: dict) -> relax.Expr:
    if not (is_carried(dtype) or is_carried(source or "")):
        return _tvm_cast(bb, x, dtype)
    if dtype in ("string", "object") or source in ("string", "object"):
        raise reject(op, "strings")
    return cast(bb, x, source, dtype, bool(attr.get("saturate", 1)), _round_mode(op, attr))


class Cast(OnnxOpConverter):
    """Every numeric cast, float8/float4/e8m0 and int4/uint4/int2/uint2 included (with
    `saturate` and, for e8m0, `round_mode`)."""

    @classmethod
    def _impl_v6(cls, bb, inputs, attr, params):
        if isinstance(inputs[0], relax.Expr) and isinstance(inputs[0].ty, relax.TensorType):
            source = input_dtypes("Cast", inputs, attr)[0]
        else:  # a shape or a prim value: TVM's converter knows those
            source = None
        return _convert("Cast", bb, inputs[0], source, dtype_name(attr["to"]), attr)


class CastLike(OnnxOpConverter):
    """Cast to the dtype of the second input, with the same dtypes and attributes as Cast."""

    @classmethod
    def _impl_v15(cls, bb, inputs, attr, params):
        if not all(isinstance(x, relax.Expr) and isinstance(x.ty, relax.TensorType)
                   for x in inputs[:2]):
            return onnx_frontend.CastLike._impl_v15(bb, inputs, attr, params)
        source, target = input_dtypes("CastLike", inputs[:2], attr)
        return _convert("CastLike", bb, inputs[0], source, target, attr)


def _bits(dtype: str) -> int:
    if dtype in SMALL_INTS or dtype == "float4_e2m1fn":
        return int(dtype[-1])
    return np.dtype(dtype).itemsize * 8


class BitCast(OnnxOpConverter):
    """Each element's bits read as another dtype of the same width (bool as a byte holding
    0 or 1; float8 formats as their byte). 4- and 2-bit dtypes and complex ones are refused."""

    @classmethod
    def _impl_v26(cls, bb, inputs, attr, params):
        source, dtype = input_dtypes("BitCast", inputs, attr)[0], dtype_name(attr["to"])
        for name in (source, dtype):
            if _bits(name) < 8 or name.startswith(("complex", "str", "object")):
                raise reject("BitCast", f"dtype {name}")
        if _bits(source) != _bits(dtype):
            raise reject("BitCast", f"{source} to {dtype} (different widths)")
        stored, wanted = carrier(source), carrier(dtype)
        if stored == wanted:
            return inputs[0]
        if "bool" in (stored, wanted):
            return relax.op.astype(inputs[0], wanted)
        return bb.emit_te(lambda t: te.compute(
            t.shape, lambda *i: tirx.reinterpret(wanted, t[i]), name="bitcast"), inputs[0])
