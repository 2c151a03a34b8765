"""Channel concats of blocked direct convs: the convs write their parts of the concat's output.

SqueezeNet's fire modules concatenate a 1x1 and a 3x3 conv's outputs along the channels; on
the blocked layout (`blocked_layout`: a concat of the channel blocks) that is a copy of both
outputs, one kernel per module (SqueezeNet 1.1: 8 concats, ~0.2 ms of 3). One image's blocked
tensor [1, C / B, H, W, B] holds each channel block whole and in order, so the convs can write
their outputs where the concat would put them: one library call runs them all into the
concat's output (`gimlet.cpu.conv2d_nchwc_direct_concat`), and no copy remains. (One call, not
a call per part writing in place: the memory planner does not see an in-place call's output
alias its input, and reused the buffer under it.)

1. Put the pass after the CPU library's dispatch (`library_dispatch.library_passes`): it
   rewrites `R.concat` along axis 1 of 5-D float32 values whose batch is statically 1, each
   part a `gimlet.cpu.conv2d_nchw_direct` call with blocked output used only by the concat.
2. It does not handle: batches other than 1 (an image's blocks are not contiguous across the
   batch), parts that are no direct conv (Winograd, depthwise, another concat: DenseNet's
   dense blocks), parts read elsewhere too.
"""

from __future__ import annotations

import collections

import tvm
from tvm import IRModule, relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..targets.libraries import CPU_LIBRARY
from .dispatch_cpu_library import DIRECT_CONV2D_FUNC, channel_concat_parts, variable_uses

CONCAT_FUNC = f"{CPU_LIBRARY.name}.conv2d_nchwc_direct_concat"
_CALL_DPS_PACKED = tvm.ir.Op.get("relax.call_dps_packed")
_PARAMS = 6  # strides, pads, dilations after (data, weight); then the epilogue's length


@tvm.transform.module_pass(opt_level=0, name="ConcatInPlace")
class ConcatInPlace:  # pylint: disable=too-few-public-methods
    """Rewrite channel concats of blocked direct convs into convs writing in place."""

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        """IRModule-level transformation."""
        rewriter = _Rewriter(mod)
        for g_var, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.use_counts = variable_uses(func)
                func = rewriter.visit_expr(func)
                rewriter.builder_.update_func(g_var, relax.analysis.remove_all_unused(func))
        return rewriter.builder_.get()


@mutator
class _Rewriter(PyExprMutator):  # pylint: disable=abstract-method
    use_counts: collections.Counter = collections.Counter()

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.concat"):
            return call
        convs = self._direct_conv_parts(call)
        if convs is None:
            return call
        args = []
        for conv in convs:
            data, weight, *rest = conv.args[1].fields
            params, epilogue = rest[:_PARAMS], rest[_PARAMS:]
            args += [data, weight, *params, relax.prim_value(len(epilogue)), *epilogue]
        return relax.call_dps_packed(CONCAT_FUNC, args, call.ty)

    def _direct_conv_parts(self, concat: relax.Call) -> list[relax.Call] | None:
        """The direct conv calls a concat along axis 1 of one image's blocked values joins
        (`channel_concat_parts`), each read only by the concat; None for any other concat."""
        parts = channel_concat_parts(concat, self.lookup_binding, self.use_counts)
        if parts is None or not all(
                isinstance(bound, relax.Call) and bound.op.same_as(_CALL_DPS_PACKED)
                and bound.args[0].global_symbol == DIRECT_CONV2D_FUNC and bound.ty_args[0].ndim == 5
                for bound in parts):
            return None
        return parts
