"""Helpers shared by the converters: constant values, static shapes, explicit rejections."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter  # noqa: F401  (re-exported)

from ..errors import ModelImportError
from ..relax_passes.checked_indexing import require as checked_values
from ..runtime.index_checks import value_check_message


class OpsetConverter(OnnxOpConverter):
    """A converter that is given the model's opset: subclasses define `_convert(bb, inputs,
    attr, params, opset)` instead of one `_impl_vN` per version."""

    @classmethod
    def get_converter(cls, opset: int):
        def convert(bb, inputs, attr, params):
            return cls._convert(bb, inputs, attr, params, opset)

        return convert


def reject(op: str, what: str) -> ModelImportError:
    """The error for a case we refuse rather than compute wrongly: `unsupported: <op> with <what>`."""
    return ModelImportError(f"unsupported: {op} with {what}")


def text_attr(attr: dict, name: str, default: str) -> str:
    """A string attribute as `str` (the importer gives bytes), `default` when absent."""
    return as_text(attr.get(name, default))


def as_text(value: str | bytes) -> str:
    """An attribute string (bytes from the importer) as `str`."""
    return value.decode() if isinstance(value, bytes) else str(value)


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


def with_fresh_shape(bb: relax.BlockBuilder, x: relax.Expr, prefix: str) -> relax.Expr:
    """`x` (known rank, shape unknown at import) cast to a shape of fresh symbolic dims."""
    dims = [tirx.Var(f"{prefix}_{i}", "int64") for i in range(rank_of(x))]
    return bb.match_cast(x, relax.TensorType(dims, dtype_of(x)))


def require(bb: relax.BlockBuilder, value: relax.Expr, ok: relax.Expr, op: str, problem: str) -> relax.Expr:
    """`value`, after a run-time check that every element of the bool tensor `ok` holds; else
    the run raises `InputError` "`op`: `problem`". Later ops must use the result."""
    return checked_values(bb, value, bb.emit(ok), value_check_message(op, problem))


def shape_from_tensor(bb: relax.BlockBuilder, shape: relax.Expr, ndim: int,
                      prefix: str) -> relax.ShapeExpr:
    """The run-time int64 tensor `shape` (length `ndim`) as a shape of symbolic dims, checked
    at run time to hold no negative size (`prefix` names the op in the error)."""
    shape = bb.match_cast(shape, relax.TensorType([ndim], "int64"))
    if ndim:
        shape = require(bb, shape, relax.op.greater_equal(shape, relax.const(0, "int64")), prefix,
                        "a size is negative")
    value = bb.emit(relax.op.tensor_to_shape(shape))
    dims = [tirx.Var(f"{prefix}_{i}", "int64") for i in range(ndim)]
    bb.match_cast(value, relax.ShapeType(dims))
    return relax.ShapeExpr(dims)


def inclusive_cumsum(bb: relax.BlockBuilder, values: relax.Expr, length: int) -> relax.Expr:
    """Running sum of a short 1-D int64 tensor of static `length` (Relax's cumsum has no
    kernel here): a product with a lower-triangular matrix of ones."""
    lower = const(np.tril(np.ones((length, length), "int64")))
    return bb.emit(relax.op.sum(relax.op.multiply(lower, values), axis=[1]))


def dim_tensor(n: Any) -> relax.Expr:
    """The dimension `n` (an int or TIR expression, possibly symbolic) as a (1,) int64 tensor."""
    return relax.op.shape_to_tensor(relax.ShapeExpr([n]))


def scalar_dim(bb: relax.BlockBuilder, value: relax.Expr | None, prefix: str) -> Any:
    """A scalar (or 1-element) integer input as a dimension: its value when constant, else a
    symbolic dimension bound at run time; None when absent."""
    if value is None:
        return None
    constant = const_value(value)
    if constant is not None:
        return tirx.IntImm("int64", int(constant.reshape(-1)[0]))
    flat = bb.emit(relax.op.reshape(relax.op.astype(value, "int64"), [1]))
    return shape_from_tensor(bb, flat, 1, prefix).values[0]
