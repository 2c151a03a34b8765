"""Recognise multi-head attention written out as MatMul, scale, mask add, Softmax, MatMul
and replace it with one `R.nn.attention`, which the CPU library runs as one fused kernel.

1. Put the pass after the canonicalization passes and before the target's library passes
   (`DispatchCPULibrary` turns the op into `gimlet.cpu.attention`); it is one of
   `graph_fusion_passes()`.
2. It matches, on 4-D float32 tensors in BNSD layout (batch, heads, sequence, head size; any
   head count, sizes symbolic or not):
   softmax(matmul(q, kT) * c + mask, axis=-1) @ v, where the scale c is any product or
   division by scalar constants (or absent), the mask add (either operand order) is optional
   and the mask broadcasts to the scores' shape from rank <= 4. The result is
   `permute_dims(R.nn.attention(q', k', v', mask, scale=c))` in BSNH layout; the transposes
   that made q, kT and v out of BSNH tensors (the usual Reshape/Transpose heads) are
   composed with the ones the op needs, and a transpose of a transpose is folded, so
   the heads reach the fused kernel without copies.
3. It does not handle: 3-D (single-head) attention, a scale applied to q or k before the
   matmul, masks that broadcast the scores to a larger shape, other dtypes, causal masks
   written as Where/Trilu, or attention on a device none of whose target's libraries takes
   attention (`TargetSpec.library_for`): the chain is left for FuseOps and the default
   schedules there.
"""

from __future__ import annotations

import tvm
from tvm import IRModule, relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..targets import spec_for
from .chain_matching import producer, product_factors, rewrite_functions

BNSD_TO_BSNH = [0, 2, 1, 3]
BNDS_TO_BSNH = [0, 3, 1, 2]  # kT [batch, heads, depth, seq] to [batch, seq, heads, depth]


@tvm.transform.module_pass(opt_level=0, name="FuseAttention")
class FuseAttention:  # pylint: disable=too-few-public-methods
    """Replace written-out attention with `R.nn.attention` on hosts with a fused kernel."""

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        """IRModule-level transformation."""
        return rewrite_functions(mod, _AttentionRewriter)


def _has_fused_kernel(ty: relax.Type) -> bool:
    """Attention on this tensor's device has a fused kernel: a library of its target (its
    virtual device's, else the target being built for) takes attention on its dtype."""
    vdevice = getattr(ty, "vdevice", None)
    target = vdevice.target if vdevice is not None else tvm.target.Target.current(allow_none=True)
    return target is not None and spec_for(target).library_for("attention", ty.dtype) is not None


def _compose(inner: list[int], outer: list[int]) -> list[int]:
    """Axes of permute_dims(permute_dims(x, inner), outer) as one permute_dims of x."""
    return [inner[a] for a in outer]


@mutator
class _AttentionRewriter(PyExprMutator):  # pylint: disable=abstract-method
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op):
            return call
        rewritten = None
        if call.op.name == "relax.matmul":
            rewritten = self._attention(call)
        elif call.op.name == "relax.permute_dims" and call.attrs.axes is not None:
            rewritten = self._permuted(call.args[0], [int(a) for a in call.attrs.axes])
        return call if rewritten is None else rewritten

    def _permuted(self, expr: relax.Expr, axes: list[int]) -> relax.Expr | None:
        """`permute_dims(expr, axes)` folded into the permute_dims `expr` is bound to (`expr`'s
        source itself when they cancel); None when `expr` is not a permute_dims."""
        inner = producer(expr, self.lookup_binding, "relax.permute_dims")
        if inner is None or inner.attrs.axes is None:
            return None
        composed = _compose([int(a) for a in inner.attrs.axes], axes)
        if composed == list(range(len(composed))):
            return inner.args[0]
        return relax.op.permute_dims(inner.args[0], composed)

    def _to_bsnh(self, expr: relax.Expr, axes: list[int]) -> relax.Expr:
        """`expr` permuted by `axes`, composed with the transpose that produced it, if any."""
        permuted = self._permuted(expr, axes)
        if permuted is None:
            permuted = relax.op.permute_dims(expr, axes)
        return permuted if isinstance(permuted, relax.Var) else self.builder_.emit(permuted)

    def _attention(self, call: relax.Call) -> relax.Expr | None:
        """The fused form of `call` = softmax(...) @ v, or None."""
        probs, value = call.args
        softmax = producer(probs, self.lookup_binding, "relax.nn.softmax")
        if softmax is None or int(softmax.attrs.axis) not in (-1, 3):
            return None
        scores = softmax.args[0]
        if not all(
            t.ty.ndim == 4 and t.ty.shape is not None and _has_fused_kernel(t.ty)
            for t in (call, value, scores)
        ):
            return None
        match, bias = self._scaled_scores(scores), None
        add = producer(scores, self.lookup_binding, "relax.add")
        if match is None and add is not None:
            for scaled, mask in (add.args, add.args[::-1]):
                match = self._scaled_scores(scaled)
                if match is not None and self._broadcasts_to(mask, scores):
                    bias = mask
                    break
                match = None
        if match is None:
            return None
        query, key_t, scale, raw_scores = match
        analyzer = tvm.sym.Analyzer()
        q_shape, k_shape, v_shape = (list(t.ty.shape) for t in (query, key_t, value))
        if not (
            query.ty.ndim == 4
            and key_t.ty.ndim == 4
            and all(
                analyzer.can_prove_equal(a, b)
                for a, b in zip(raw_scores.ty.shape, scores.ty.shape)
            )
            and all(
                analyzer.can_prove_equal(q_shape[i], other[i])
                for other in (k_shape, v_shape)
                for i in (0, 1)
            )
            and analyzer.can_prove_equal(k_shape[3], v_shape[2])
        ):
            return None
        if bias is not None and bias.ty.ndim < 4:
            bias = self.builder_.emit(
                relax.op.expand_dims(bias, list(range(4 - bias.ty.ndim)))
            )
        fused = self.builder_.emit(
            relax.op.nn.attention(
                self._to_bsnh(query, BNSD_TO_BSNH),
                self._to_bsnh(key_t, BNDS_TO_BSNH),
                self._to_bsnh(value, BNSD_TO_BSNH),
                bias,
                scale=scale,
            )
        )
        return relax.op.permute_dims(fused, BNSD_TO_BSNH)

    def _scaled_scores(
        self, expr: relax.Expr
    ) -> tuple[relax.Expr, relax.Expr, float, relax.Expr] | None:
        """(q, kT, c, matmul(q, kT)) when `expr` is c * matmul(q, kT), c scalar constants."""
        factors, scale = product_factors(expr, self.lookup_binding)
        if len(factors) != 1:
            return None
        matmul = producer(factors[0], self.lookup_binding, "relax.matmul")
        if matmul is None or factors[0].ty.ndim != expr.ty.ndim:
            return None
        return matmul.args[0], matmul.args[1], scale, factors[0]

    @staticmethod
    def _broadcasts_to(mask: relax.Expr, scores: relax.Expr) -> bool:
        """`mask` has rank <= 4 and each of its extents is 1 or the scores' extent."""
        ty = mask.ty
        if not isinstance(ty, relax.TensorType) or ty.shape is None or ty.ndim > 4:
            return False
        if ty.dtype != scores.ty.dtype:
            return False
        analyzer = tvm.sym.Analyzer()
        full = list(scores.ty.shape)[4 - ty.ndim :]
        return all(
            (isinstance(d, tvm.tirx.IntImm) and int(d) == 1) or analyzer.can_prove_equal(d, f)
            for d, f in zip(ty.shape, full)
        )
