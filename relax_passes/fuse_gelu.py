"""Recognise GELU written out as an elementwise chain and replace it with `R.nn.gelu` (erf
form) or `R.nn.gelu_tanh` (tanh approximation).

1. Put the pass after the canonicalization passes (constants folded) and before LegalizeOps
   and before epilogue fusion, so a GELU after a matmul is seen as one activation; it is
   one of `graph_fusion_passes()`.
2. It matches, for a float tensor x of any shape, products (in any order and grouping,
   scalar constants multiplied out, divisions by constants included) equal to
   - erf form: 0.5 * x * (1 + erf(x / sqrt(2)));
   - tanh form: 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3))), with x ** 3
     written as a power or as x * x * x.
   Constants must equal the exact values up to fp32 rounding.
3. It does not handle: the expanded sum x * (0.5 + 0.5 * erf(...)), sigmoid approximations
   (x * sigmoid(1.702 * x)), or constants that broadcast x to a larger shape. Those chains
   stay as they are.
"""

from __future__ import annotations

import math

import tvm
from tvm import IRModule, relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .chain_matching import (
    count_matching,
    has_unit_broadcast,
    is_close,
    is_float_tensor,
    producer,
    product_factors,
    rewrite_functions,
    scalar_value,
)

SQRT_HALF = 1.0 / math.sqrt(2.0)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
TANH_CUBIC = 0.044715
PRODUCT_OPS = ("relax.multiply", "relax.divide")


@tvm.transform.module_pass(opt_level=0, name="FuseGELU")
class FuseGELU:  # pylint: disable=too-few-public-methods
    """Replace written-out GELU chains with `R.nn.gelu` / `R.nn.gelu_tanh`."""

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        """IRModule-level transformation."""
        return rewrite_functions(mod, _GELURewriter)


@mutator
class _GELURewriter(PyExprMutator):  # pylint: disable=abstract-method
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        is_product = isinstance(call.op, tvm.ir.Op) and call.op.name in PRODUCT_OPS
        if not (is_product and is_float_tensor(call)):
            return call
        factors, constant = product_factors(call, self.lookup_binding)
        if len(factors) != 2 or not is_close(constant, 0.5):
            return call
        if not all(has_unit_broadcast(c, call) for c in self._constants_of(call)):
            return call
        for x, one_plus in (factors, factors[::-1]):
            if x.ty.ndim != call.ty.ndim or x.ty.dtype != call.ty.dtype:
                continue
            inner = self._one_plus(one_plus)
            if inner is None:
                continue
            erf = producer(inner, self.lookup_binding, "relax.erf")
            if erf is not None and self._is_scaled(erf.args[0], x, SQRT_HALF):
                return relax.op.nn.gelu(x)
            tanh = producer(inner, self.lookup_binding, "relax.tanh")
            if tanh is not None and self._is_tanh_argument(tanh.args[0], x):
                return relax.op.nn.gelu_tanh(x)
        return call

    def _constants_of(self, call: relax.Expr) -> list[relax.Expr]:
        """The constant operands of the multiply chain ending at `call`."""
        found, pending = [], [call]
        while pending:
            term = producer(pending.pop(), self.lookup_binding, *PRODUCT_OPS)
            if term is None:
                continue
            for arg in term.args:
                if scalar_value(arg, self.lookup_binding) is not None:
                    found.append(arg)
                else:
                    pending.append(arg)
        return found

    def _one_plus(self, expr: relax.Expr) -> relax.Expr | None:
        """`t` when `expr` is `1 + t` (either order)."""
        add = producer(expr, self.lookup_binding, "relax.add")
        if add is None:
            return None
        for one, term in (add.args, add.args[::-1]):
            if scalar_value(one, self.lookup_binding) == 1.0:
                return term
        return None

    def _is_scaled(self, expr: relax.Expr, x: relax.Expr, scale: float) -> bool:
        """`expr` is `scale * x` (as a product or a division)."""
        factors, constant = product_factors(expr, self.lookup_binding)
        return len(factors) == 1 and factors[0].same_as(x) and is_close(constant, scale)

    def _is_tanh_argument(self, expr: relax.Expr, x: relax.Expr) -> bool:
        """`expr` is sqrt(2 / pi) * (x + 0.044715 * x ** 3)."""
        factors, constant = product_factors(expr, self.lookup_binding)
        if len(factors) != 1 or not is_close(constant, SQRT_2_OVER_PI):
            return False
        add = producer(factors[0], self.lookup_binding, "relax.add")
        if add is None:
            return False
        for linear, cubic in (add.args, add.args[::-1]):
            cubic_factors, cubic_constant = product_factors(cubic, self.lookup_binding)
            if (
                linear.same_as(x)
                and len(cubic_factors) == 3
                and count_matching(cubic_factors, x) == 3
                and is_close(cubic_constant, TANH_CUBIC)
            ):
                return True
        return False
