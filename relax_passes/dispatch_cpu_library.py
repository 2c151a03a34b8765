"""Hand fp32 matmul and NCHW conv2d to gimlet's OpenBLAS-backed CPU library.

1. Put the pass before LegalizeOps: it rewrites high-level Relax ops, which legalization
   would otherwise turn into TIR.
2. It rewrites
   - `R.matmul(a, b)` and `R.matmul(a, R.permute_dims(w))` (a transpose of the last two axes)
     into `R.call_dps_packed("gimlet.cpu.matmul", (a, b_or_w, transpose_b))`, for float32
     operands of rank >= 2 with any (also symbolic) batch axes that broadcast;
   - `R.nn.conv2d` with NCHW data, OIHW weights and NCHW output into
     `R.call_dps_packed("gimlet.cpu.conv2d_nchw", (data, weight, strides, pads, dilations,
     groups))`, for float32 and any `groups` except depthwise.
3. It does not handle: other dtypes or mixed-precision `out_dtype`, rank-1 matmul operands,
   transposes of other axes than the last two, other layouts, depthwise conv2d (each output
   channel reads one input channel: that stays in TIR, where FuseOps can fuse its epilogue),
   and operands or results whose shape is unknown, and ops placed off the host (their tensors'
   virtual device is not an LLVM one). Those ops stay as they were.
4. Elementwise ops around the rewritten calls (bias add, activations, residual adds) are left
   alone, so FuseOps still fuses them with each other.

The packed functions come from `runtime/ext/cpu_library.cc`. The pass loads that extension
(building it on first use), so the functions exist when the module is built and run in this
process; another process running the compiled module must load it too (`gimlet_tvm.runtime`).
"""

from __future__ import annotations

import tvm
from tvm import IRModule, relax
from tvm.relax.expr_functor import PyExprMutator, mutator

MATMUL_FUNC = "gimlet.cpu.matmul"
CONV2D_FUNC = "gimlet.cpu.conv2d_nchw"


@tvm.transform.module_pass(opt_level=0, name="DispatchCPULibrary")
class DispatchCPULibrary:  # pylint: disable=too-few-public-methods
    """Rewrite fp32 matmul and NCHW conv2d into calls of gimlet's CPU library."""

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        """IRModule-level transformation."""
        # Imported here: gimlet_tvm.runtime imports the compiler, which imports this module.
        from ..runtime.extensions import load_extensions  # pylint: disable=import-outside-toplevel

        load_extensions()
        rewriter = _LibraryCallRewriter(mod)
        for g_var, func in mod.functions_items():
            if isinstance(func, relax.Function):
                func = rewriter.visit_expr(func)
                # Transposes folded into calls are now unused.
                rewriter.builder_.update_func(g_var, relax.analysis.remove_all_unused(func))
        return rewriter.builder_.get()


def _is_float32_tensor(ty: relax.Type, min_ndim: int) -> bool:
    return (
        isinstance(ty, relax.TensorType)
        and ty.dtype == "float32"
        and ty.ndim >= min_ndim
        and ty.shape is not None
    )


def _on_host(ty: relax.Type) -> bool:
    """Whether a result lives on the host: no virtual device, or an LLVM one (placement puts
    ops elsewhere by giving their tensors another device)."""
    vdevice = getattr(ty, "vdevice", None)
    return vdevice is None or vdevice.target is None or vdevice.target.kind.name == "llvm"


def _static_ints(values) -> list[int] | None:
    """The values as Python ints, or None when one of them is symbolic."""
    if not all(isinstance(v, (int, tvm.tirx.IntImm)) for v in values):
        return None
    return [int(v) for v in values]


@mutator
class _LibraryCallRewriter(PyExprMutator):  # pylint: disable=abstract-method
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or not _on_host(call.ty):
            return call
        rewritten = None
        if call.op.name == "relax.matmul":
            rewritten = self._rewrite_matmul(call)
        elif call.op.name == "relax.nn.conv2d":
            rewritten = self._rewrite_conv2d(call)
        return call if rewritten is None else rewritten

    def _transposed_operand(self, expr: relax.Expr) -> relax.Expr | None:
        """`w` when `expr` is bound to `permute_dims(w)` swapping exactly the last two axes."""
        if not isinstance(expr, relax.Var):
            return None
        value = self.lookup_binding(expr)
        if not (
            isinstance(value, relax.Call)
            and isinstance(value.op, tvm.ir.Op)
            and value.op.name == "relax.permute_dims"
        ):
            return None
        ndim = value.args[0].ty.ndim
        if ndim < 2:
            return None
        swap_last = list(range(ndim))
        swap_last[-1], swap_last[-2] = swap_last[-2], swap_last[-1]
        axes = value.attrs.axes
        if axes is None and ndim != 2:
            return None
        if axes is not None and [int(a) for a in axes] != swap_last:
            return None
        return value.args[0]

    def _rewrite_matmul(self, call: relax.Call) -> relax.Expr | None:
        a, b = call.args
        if not (
            _is_float32_tensor(a.ty, 2)
            and _is_float32_tensor(b.ty, 2)
            and _is_float32_tensor(call.ty, 2)
        ):
            return None
        weight = self._transposed_operand(b)
        args = [a, b, relax.prim_value(0)] if weight is None else [a, weight, relax.prim_value(1)]
        return relax.call_dps_packed(MATMUL_FUNC, args, call.ty)

    def _rewrite_conv2d(self, call: relax.Call) -> relax.Expr | None:
        data, weight = call.args
        attrs = call.attrs
        if not (
            _is_float32_tensor(data.ty, 4)
            and _is_float32_tensor(weight.ty, 4)
            and _is_float32_tensor(call.ty, 4)
            and attrs.data_layout == "NCHW"
            and attrs.kernel_layout == "OIHW"
            and attrs.out_layout == "NCHW"
        ):
            return None
        groups = int(attrs.groups)
        channels_per_group = _static_ints([weight.ty.shape[1]])
        if groups > 1 and channels_per_group == [1]:
            return None  # depthwise
        params = _static_ints([*attrs.strides, *attrs.padding[:2], *attrs.dilation])
        if params is None:
            return None
        args = [data, weight, *(relax.prim_value(p) for p in params), relax.prim_value(groups)]
        return relax.call_dps_packed(CONV2D_FUNC, args, call.ty)
