"""Make negated float comparisons and float `!=` exact for NaN operands.

Under IEEE 754 every ordered comparison with a NaN is false, so `not(a < b)` is true when a
or b is NaN, and so is `a != b`. TVM gets both wrong once they reach a kernel: its
simplifier rewrites `!(a < b)` to `b <= a` (false for NaN) and its LLVM code generator
compiles `!=` as the ordered "one" comparison (false for NaN). An ONNX `Not(Less(x, y))` or
`Not(Equal(x, x))` (a NaN test) then computes something else without a word.

1. Put the pass with the canonicalization passes, before any fusion, so every target's
   kernels get the rewritten form.
2. For float operands it rewrites `logical_not(cmp(a, b))` (cmp one of <, <=, >, >=, ==, !=)
   to the complementary comparison, or-ed with `isnan(a) | isnan(b)` where the complement
   must be true for NaN, and `not_equal(a, b)` to `not_equal(a, b) | isnan(a) | isnan(b)`.
   Neither form has a negation for the simplifier to move, and no `!=` is left to decide NaN.
3. It does not handle negations the simplifier builds itself from other forms (a `where`
   with swapped branches stays a `where`), nor integer comparisons (no NaN there).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import IRModule, relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .chain_matching import rewrite_functions

_op = relax.op
# comparison -> (its complement, whether the complement must hold for NaN operands)
_COMPLEMENT = {
    "relax.less": (_op.greater_equal, True),
    "relax.less_equal": (_op.greater, True),
    "relax.greater": (_op.less_equal, True),
    "relax.greater_equal": (_op.less, True),
    "relax.equal": (_op.not_equal, True),
    "relax.not_equal": (_op.equal, False),
}


@tvm.transform.module_pass(opt_level=0, name="NaNSafeComparisons")
class NaNSafeComparisons:  # pylint: disable=too-few-public-methods
    """Rewrite negated float comparisons and float `!=` so NaN operands give IEEE results."""

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        """IRModule-level transformation."""
        return rewrite_functions(mod, _ComparisonRewriter)


def _op_name(expr: relax.Expr) -> str | None:
    return expr.op.name if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) else None


def _is_float(expr: relax.Expr) -> bool:
    ty = expr.ty
    return isinstance(ty, relax.TensorType) and "float" in str(ty.dtype)


def _isnan_operand(x: relax.Expr) -> relax.Expr:
    """`x`, as float32 when bfloat16 (TVM has no bfloat16 isnan)."""
    return _op.astype(x, "float32") if str(x.ty.dtype) == "bfloat16" else x


def _or_nan(result: relax.Expr, a: relax.Expr, b: relax.Expr) -> relax.Expr:
    """`result | isnan(a) | isnan(b)`, leaving out constants that hold no NaN. Or-ed as uint8
    maxima: TVM's vectorized LLVM code mixes i1 and i8 in a `logical_or` with `isnan`."""
    terms = [result] + [
        _op.isnan(_isnan_operand(operand)) for operand in (a, b)
        if not (isinstance(operand, tvm.ir.GenericConst) and not np.isnan(operand.value.numpy()).any())
    ]
    if len(terms) == 1:
        return result
    flags = [_op.astype(term, "uint8") for term in terms]
    combined = flags[0]
    for flag in flags[1:]:
        combined = _op.maximum(combined, flag)
    return _op.astype(combined, "bool")


@mutator
class _ComparisonRewriter(PyExprMutator):  # pylint: disable=abstract-method
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        name = _op_name(call)
        if name == "relax.not_equal" and _is_float(call.args[0]):
            return _or_nan(call, *call.args)
        if name != "relax.logical_not":
            return call
        operand = call.args[0]
        if isinstance(operand, relax.Var) and self.lookup_binding(operand) is not None:
            operand = self.lookup_binding(operand)
        compared = _op_name(operand)
        if compared not in _COMPLEMENT or not _is_float(operand.args[0]):
            return call
        complement, true_for_nan = _COMPLEMENT[compared]
        a, b = operand.args
        result = complement(a, b)
        return _or_nan(result, a, b) if true_for_nan else result
