"""ONNX dtypes TVM cannot compute with, and the byte-sized dtypes that carry them.

float8 (e4m3fn, e4m3fnuz, e5m2, e5m2fnuz, e8m0fnu) and float4_e2m1fn travel through a
compiled model as their bit pattern in uint8; int4/int2 as their value in int8, uint4/uint2
as their value in uint8. Only our converters read them (`onnx_ops.casts`, `onnx_ops.quantize`);
the runtime converts at the model boundary, so users pass and get ml_dtypes arrays.
"""

from __future__ import annotations

import ml_dtypes  # noqa: F401  (registers its dtype names with numpy)
import numpy as np

FLOAT_BITS = {
    name: "uint8" for name in (
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn")
}
"""Formats carried as bit patterns in uint8."""

SMALL_INTS = {"int4": "int8", "int2": "int8", "uint4": "uint8", "uint2": "uint8"}
"""Integers carried as values in a byte."""

CARRIERS = {**FLOAT_BITS, **SMALL_INTS}
_CARRIED = frozenset(np.dtype(name) for name in CARRIERS)
"""The same as dtypes: comparing a dtype costs about 50 ns, its `.name` about 2 us, a few
percent of a small model's call."""


def is_carried(dtype: str) -> bool:
    """Whether `dtype` (numpy/ml_dtypes name) travels in a carrier dtype."""
    return str(dtype) in CARRIERS


def carrier(dtype: str) -> str:
    """The dtype a tensor of `dtype` has inside a compiled model."""
    return CARRIERS.get(str(dtype), str(dtype))


def to_carrier(array: np.ndarray) -> np.ndarray:
    """`array` as its carrier (unchanged when its dtype needs none)."""
    if array.dtype not in _CARRIED:
        return array
    name = array.dtype.name
    if name in FLOAT_BITS:
        return array.view(np.uint8)
    if name in SMALL_INTS:
        return array.astype(SMALL_INTS[name])
    return array


def from_carrier(array: np.ndarray, dtype: str) -> np.ndarray:
    """A carrier array (as `to_carrier` gives) back as `dtype`."""
    if dtype in FLOAT_BITS:
        return array.view(dtype)
    if dtype in SMALL_INTS:
        return array.astype(dtype)
    return array
