"""Recognise LayerNorm and RMSNorm written out as elementwise chains and replace each chain
with one `R.nn.layer_norm` / `R.nn.rms_norm`, which legalizes to a single kernel.

1. Put the pass after the canonicalization passes (bindings canonicalized, constants folded)
   and before LegalizeOps; it is one of `graph_fusion_passes()`.
2. It matches, over the last axis of a float tensor x (any rank, any epsilon):
   - LayerNorm: c = x - mean(x); v = mean(c * c) (or mean(c ** 2));
     y = c / sqrt(v + eps) (or c * rsqrt(v + eps));
   - RMSNorm: v = mean(x * x) (or mean(x ** 2)); y = x / sqrt(v + eps) (or x * rsqrt(v + eps));
   - then, on either result, a following multiply by a last-axis vector (gamma) and, for
     LayerNorm, a following add of a last-axis vector (beta); commutative operands in any
     order. The means reduce the last axis only, with keepdims.
3. It does not handle: normalization over several or non-last axes, a variance written as
   mean(x * x) - mean(x) ** 2, gamma/beta that broadcast over other axes than the last,
   symbolic hidden sizes (the op needs constant unit gamma / zero beta), or a beta added
   before the gamma multiply. Those chains stay as they are.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import IRModule, relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .chain_matching import (
    filled_like_last_axis,
    is_float_tensor,
    last_axis_vector,
    producer,
    product_factors,
    rewrite_functions,
    scalar_value,
)

NORM_OPS = ("relax.nn.layer_norm", "relax.nn.rms_norm")


@tvm.transform.module_pass(opt_level=0, name="FuseNormalization")
class FuseNormalization:  # pylint: disable=too-few-public-methods
    """Replace written-out LayerNorm / RMSNorm chains with `R.nn.layer_norm` / `R.nn.rms_norm`."""

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        """IRModule-level transformation."""
        return rewrite_functions(mod, _NormalizationRewriter)


@mutator
class _NormalizationRewriter(PyExprMutator):  # pylint: disable=abstract-method
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or not is_float_tensor(call):
            return call
        name = call.op.name
        rewritten = None
        if name == "relax.divide":
            rewritten = self._normalize(call.args[0], call.args[1], "relax.sqrt")
        elif name == "relax.multiply":
            for value, other in (call.args, call.args[::-1]):
                rewritten = self._normalize(value, other, "relax.rsqrt")
                if rewritten is None:
                    rewritten = self._with_gamma(value, other)
                if rewritten is not None:
                    break
        elif name == "relax.add":
            rewritten = self._with_beta(*call.args)
            if rewritten is None:
                rewritten = self._with_beta(*call.args[::-1])
        return call if rewritten is None else rewritten

    def _last_axis_mean(self, expr: relax.Expr) -> relax.Expr | None:
        """`t` when `expr` is `mean(t)` over t's last axis with keepdims."""
        mean = producer(expr, self.lookup_binding, "relax.mean")
        if mean is None or not mean.attrs.keepdims or mean.attrs.axis is None:
            return None
        ndim = mean.args[0].ty.ndim
        axes = [int(a) % ndim for a in mean.attrs.axis]
        return mean.args[0] if axes == [ndim - 1] else None

    def _normalize(self, value: relax.Expr, root: relax.Expr, root_op: str) -> relax.Expr | None:
        """The norm op for `value / sqrt(v + eps)` (`root_op` sqrt) or `value * rsqrt(v + eps)`
        (`root_op` rsqrt, `root` the rsqrt), when v is the last-axis mean square of `value`
        and `value` is x or x - mean(x)."""
        root_call = producer(root, self.lookup_binding, root_op)
        add = None if root_call is None else producer(root_call.args[0], self.lookup_binding, "relax.add")
        if add is None:
            return None
        for variance, eps_expr in (add.args, add.args[::-1]):
            eps = scalar_value(eps_expr, self.lookup_binding)
            squared = self._last_axis_mean(variance)
            if eps is None or squared is None:
                continue
            factors, constant = product_factors(squared, self.lookup_binding)
            if constant != 1.0 or len(factors) != 2 or not all(f.same_as(value) for f in factors):
                continue
            return self._norm_of(value, eps)
        return None

    def _norm_of(self, value: relax.Expr, eps: float) -> relax.Expr | None:
        """LayerNorm of x when `value` is x - mean(x), else RMSNorm of `value`; unit affine."""
        centered = producer(value, self.lookup_binding, "relax.subtract")
        if centered is not None:
            x, mean = centered.args
            mean_of = self._last_axis_mean(mean)
            if mean_of is not None and mean_of.same_as(x):
                ones, zeros = filled_like_last_axis(x, 1.0), filled_like_last_axis(x, 0.0)
                if ones is None or x.ty.ndim != value.ty.ndim:
                    return None
                return relax.op.nn.layer_norm(x, ones, zeros, axes=[-1], epsilon=eps)
        ones = filled_like_last_axis(value, 1.0)
        return None if ones is None else relax.op.nn.rms_norm(value, ones, axes=[-1], epsilon=eps)

    def _with_gamma(self, normed: relax.Expr, gamma: relax.Expr) -> relax.Expr | None:
        """The norm `normed` is bound to, scaled by `gamma`, when its affine is the identity."""
        norm = producer(normed, self.lookup_binding, *NORM_OPS)
        if norm is None or not self._is_filled(norm.args[1], 1.0):
            return None
        if norm.op.name == "relax.nn.layer_norm" and not self._is_filled(norm.args[2], 0.0):
            return None
        vector = last_axis_vector(gamma, normed, self.lookup_binding)
        if vector is None:
            return None
        return relax.Call(norm.op, [norm.args[0], vector, *norm.args[2:]], norm.attrs)

    def _with_beta(self, normed: relax.Expr, beta: relax.Expr) -> relax.Expr | None:
        """The LayerNorm `normed` is bound to, shifted by `beta`, when it has no shift yet."""
        norm = producer(normed, self.lookup_binding, "relax.nn.layer_norm")
        if norm is None or not self._is_filled(norm.args[2], 0.0):
            return None
        vector = last_axis_vector(beta, normed, self.lookup_binding)
        if vector is None:
            return None
        return relax.Call(norm.op, [norm.args[0], norm.args[1], vector], norm.attrs)

    def _is_filled(self, expr: relax.Expr, value: float) -> bool:
        """`expr` is a constant whose elements all equal `value`."""
        if isinstance(expr, relax.Var):
            expr = self.lookup_binding(expr)
        return isinstance(expr, tvm.ir.GenericConst) and bool(np.all(expr.value.numpy() == value))
