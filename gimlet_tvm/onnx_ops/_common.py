"""Helpers shared by the converters: constant values, static shapes, explicit rejections."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter  # noqa: F401  (re-exported)

from ..errors import ModelImportError


def reject(op: str, what: str) -> ModelImportError:
    """The error for a case we refuse rather than compute wrongly: `unsupported: <op> with <what>`."""
    return ModelImportError(f"unsupported: {op} with {what}")


def const_value(expr: relax.Expr | None) -> np.ndarray | None:
    """The value of `expr` if it is a constant, else None."""
    if isinstance(expr, tvm.ir.GenericConst):
        return expr.value.numpy()
    return None


def static_shape(expr: relax.Expr) -> list[int] | None:
    """`expr`'s shape as ints when fully known at import time, else None."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    values = getattr(ty.shape, "values", None)
    if values is None:
        return None
    try:
        return [int(v) for v in values]
    except TypeError:
        return None


def dtype_of(expr: relax.Expr) -> str:
    """The element dtype of a tensor expression."""
    return str(expr.ty.dtype)


def rank_of(expr: relax.Expr) -> int:
    """The rank of a tensor expression (-1 if unknown)."""
    return int(expr.ty.ndim)


def normalize_axes(axes: Sequence[int], rank: int) -> list[int]:
    """Axes with negative values counted from the end."""
    return [int(a) + rank if a < 0 else int(a) for a in axes]


def optional_input(inputs: Sequence[Any], index: int) -> Any:
    """`inputs[index]`, or None when the input is absent or empty."""
    return inputs[index] if len(inputs) > index and inputs[index] is not None else None


def scalar(value: float | int | bool, dtype: str) -> relax.Constant:
    """A 0-d constant of `dtype`."""
    return relax.const(np.array(value).astype(dtype), dtype)


def const(value: np.ndarray) -> relax.Constant:
    """A constant with `value`'s own dtype (`relax.const` turns int64 arrays into int32)."""
    value = np.asarray(value)
    return relax.const(value, value.dtype.name)
