"""Helpers the graph-fusion passes share to read elementwise chains in a Relax dataflow graph.

Matching walks from the last op of a chain back to its producers through variable bindings
(`lookup`, e.g. `PyExprMutator.lookup_binding`), so it sees the graph as the importer wrote
it, op by op, whatever the order of commutative operands.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import tvm
from tvm import relax

Lookup = Callable[[relax.Var], "relax.Expr | None"]

# Constants in exported graphs are fp32 roundings of the exact values (or shorter decimals).
CONSTANT_RTOL = 1e-5


def producer(expr: relax.Expr, lookup: Lookup, *op_names: str) -> relax.Call | None:
    """The call of one of `op_names` that `expr` is (or is bound to), else None."""
    if isinstance(expr, relax.Var):
        expr = lookup(expr)
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        if expr.op.name in op_names:
            return expr
    return None


def scalar_value(expr: relax.Expr, lookup: Lookup) -> float | None:
    """The value of a constant with one element (any rank), else None."""
    if isinstance(expr, relax.Var):
        expr = lookup(expr)
    if not isinstance(expr, tvm.ir.GenericConst):
        return None
    values = expr.value.numpy()
    return float(values.reshape(-1)[0]) if values.size == 1 else None


def is_close(value: float | None, want: float) -> bool:
    """`value` equals `want` up to the rounding of a stored constant."""
    return value is not None and math.isclose(value, want, rel_tol=CONSTANT_RTOL)


def product_factors(expr: relax.Expr, lookup: Lookup) -> tuple[list[relax.Expr], float]:
    """`expr` as a product: its non-constant factors (a `power(x, k)` with small integer k
    counts as k factors x) and the product of its scalar constant factors.

    Multiplications are followed through bindings; divisions by a scalar constant count as
    multiplication by its inverse.
    """
    factors: list[relax.Expr] = []
    constant = 1.0
    pending = [expr]
    while pending:
        term = pending.pop()
        value = scalar_value(term, lookup)
        if value is not None:
            constant *= value
            continue
        call = producer(term, lookup, "relax.multiply", "relax.divide", "relax.power")
        if call is None:
            factors.append(term)
        elif call.op.name == "relax.multiply":
            pending += list(call.args)
        elif call.op.name == "relax.divide" and scalar_value(call.args[1], lookup):
            constant /= scalar_value(call.args[1], lookup)
            pending.append(call.args[0])
        elif call.op.name == "relax.power" and _small_integer(scalar_value(call.args[1], lookup)):
            pending += [call.args[0]] * int(scalar_value(call.args[1], lookup))
        else:
            factors.append(term)
    return factors, constant


def _small_integer(value: float | None) -> bool:
    return value is not None and value in (2.0, 3.0)


def count_matching(factors: list[relax.Expr], x: relax.Expr) -> int:
    """How many of `factors` are `x`."""
    return sum(1 for f in factors if f.same_as(x))


def has_unit_broadcast(small: relax.Expr, big: relax.Expr) -> bool:
    """`small` broadcast against `big` yields `big`'s shape: `small` has no more axes and every
    axis of it is 1 (a scalar-like constant)."""
    small_ty, big_ty = small.ty, big.ty
    if not isinstance(small_ty, relax.TensorType) or small_ty.shape is None:
        return False
    if small_ty.ndim > big_ty.ndim:
        return False
    return all(isinstance(d, tvm.tirx.IntImm) and int(d) == 1 for d in small_ty.shape)


def last_axis_vector(vector: relax.Expr, x: relax.Expr, lookup: Lookup) -> relax.Expr | None:
    """`vector` as a 1-D tensor of `x`'s last-axis length, when broadcasting it against `x`
    scales along the last axis only (shape [..., 1, H] with no more axes than `x`); else None.
    Constants are reshaped here; other tensors get a reshape op."""
    ty, x_ty = vector.ty, x.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None or ty.ndim < 1:
        return None
    if ty.ndim > x_ty.ndim or ty.dtype != x_ty.dtype:
        return None
    analyzer = tvm.sym.Analyzer()
    if not analyzer.can_prove_equal(ty.shape[-1], x_ty.shape[-1]):
        return None
    if not all(isinstance(d, tvm.tirx.IntImm) and int(d) == 1 for d in list(ty.shape)[:-1]):
        return None
    if ty.ndim == 1:
        return vector
    bound = lookup(vector) if isinstance(vector, relax.Var) else vector
    if isinstance(bound, tvm.ir.GenericConst):
        return relax.const(bound.value.numpy().reshape(-1), str(ty.dtype))
    return relax.op.reshape(vector, [ty.shape[-1]])


def filled_like_last_axis(x: relax.Expr, value: float) -> tvm.ir.GenericConst | None:
    """A 1-D constant of `x`'s last-axis length filled with `value` (None if that length is
    symbolic)."""
    length = x.ty.shape[-1]
    if not isinstance(length, tvm.tirx.IntImm):
        return None
    dtype = str(x.ty.dtype)
    return relax.const(np.full(int(length), value, dtype=dtype), dtype)


def is_float_tensor(expr: relax.Expr) -> bool:
    """A float tensor of known rank and shape."""
    ty = expr.ty
    return (
        isinstance(ty, relax.TensorType)
        and ty.shape is not None
        and ty.ndim >= 1
        and str(ty.dtype) in ("float16", "float32", "float64", "bfloat16")
    )


def rewrite_functions(mod: tvm.IRModule, make_rewriter: Callable[[tvm.IRModule], object]) -> tvm.IRModule:
    """Run a `PyExprMutator` over every Relax function of `mod`, dropping the bindings its
    rewrites left unused."""
    rewriter = make_rewriter(mod)
    for g_var, func in mod.functions_items():
        if isinstance(func, relax.Function):
            func = rewriter.visit_expr(func)
            rewriter.builder_.update_func(g_var, relax.analysis.remove_all_unused(func))
    return rewriter.builder_.get()
