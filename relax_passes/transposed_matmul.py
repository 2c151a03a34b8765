"""`x @ permute_dims(w)` (a linear layer: `w` is [out, in]) as one kernel that reads `w` in place.

Where it goes: after library dispatch (a library takes the pairs it handles first), before
LegalizeOps, for targets whose spec asks for it (`TargetSpec.transposed_matmul_kernels`).
Legalized as they are, the two ops are a transpose kernel that copies the whole weight at every
call and a matmul; rewritten, they are one `call_tir` of `out[..., j] = sum_k x[..., k] w[j, k]`,
which the target's schedule rules take as a plain reduction.

TVM has `relax.transform.FuseTransposeMatmul` for this, but on ONNX GRU and LSTM's recurrent
products (`test_gru_bidirectional`, `test_lstm_reverse`) it built its fused kernel with the
operands swapped and the compile failed; here the operands are taken from the matmul itself.

What it does not handle: a `w` of other than 2 dimensions, a 1-D `x`, operands of different
dtypes or an `out_dtype` other than theirs: those stay as they are.
"""

from __future__ import annotations

import tvm
from tvm import IRModule, relax, te
from tvm.relax.expr_functor import PyExprMutator, mutator


def transposed_matmul(x: te.Tensor, w: te.Tensor) -> te.Tensor:
    """x[..., k] @ w[n, k]^T -> [..., n]."""
    k = te.reduce_axis((0, w.shape[1]), name="k")
    return te.compute((*x.shape[:-1], w.shape[0]),
                      lambda *i: te.sum(x[(*i[:-1], k)] * w[i[-1], k], axis=k), name="T_matmul_transposed")


def _weight_of(call: relax.Expr | None) -> relax.Expr | None:
    """`w` when `call` is `permute_dims(w)` swapping the two axes of a 2-D `w`."""
    if not (isinstance(call, relax.Call) and call.op == tvm.ir.Op.get("relax.permute_dims")):
        return None
    weight = call.args[0]
    if not (isinstance(weight.ty, relax.TensorType) and weight.ty.ndim == 2):
        return None
    axes = call.attrs.axes
    return weight if axes is None or [int(a) for a in axes] == [1, 0] else None


def _other_out_dtype(call: relax.Call, dtype: str) -> bool:
    out = str(call.attrs.out_dtype) if call.attrs.out_dtype is not None else ""
    return out not in ("", "void", dtype)


@mutator
class _Rewriter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != tvm.ir.Op.get("relax.matmul"):
            return call
        x, transposed = call.args
        weight = _weight_of(self.lookup_binding(transposed) if isinstance(transposed, relax.Var) else transposed)
        x_info = x.ty
        if (weight is None or not isinstance(x_info, relax.TensorType) or x_info.ndim < 2
                or x_info.dtype != weight.ty.dtype or _other_out_dtype(call, x_info.dtype)):
            return call
        return self.builder_.call_te(transposed_matmul, x, weight, primfunc_name_hint="matmul_transposed")


@tvm.transform.module_pass(opt_level=0, name="TransposedMatmulKernels")
def transposed_matmul_kernels(mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
    """Every `matmul(x, permute_dims(w))` of the module's Relax functions as one kernel."""
    rewriter = _Rewriter(mod)
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
    return relax.transform.DeadCodeElimination()(rewriter.builder_.get())
