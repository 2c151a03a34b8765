"""Shapes computed at run time are checked to fit in memory before anything is allocated.

A converter that sizes its output from a run-time tensor (Tile's repeats, Range's limits,
Pad's pads, ConstantOfShape, Resize's sizes, a Reshape or Expand target) turns that tensor
into a shape with `R.tensor_to_shape`. Sizes each within int64 can still multiply past it:
Tile of a 3x4 tensor by [2^40, 2^20] asks for 12 * 2^60 elements, whose byte count the VM
computes modulo 2^64 (0 here), allocates, and the kernel then writes past the allocation:
the process dies (heap corruption, a segmentation fault) where onnxruntime fails to
allocate.

1. Put the pass right after import, before constant folding: it rewrites every
   `R.tensor_to_shape(t)` whose `t` is not a constant.
2. `t` goes through `checked_indexing.require` first: the product of its sizes (each counted
   as at least 1, in float32, which cannot wrap) must be at most `MAX_ELEMENTS`, else the run
   raises `InputError`. The product with zeros counted as 1 bounds every tensor whose dims
   are these sizes and a few constants, also where another size is 0.
3. It does not handle: shapes whose sizes come from several run-time tensors multiplied
   together in one tensor (each tensor's product is checked on its own); symbolic dims of the
   model's inputs (the caller's arrays exist, so their sizes fit).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..runtime.index_checks import value_check_message
from .checked_indexing import require

# 2^44 elements: 64 TiB of float32, past the memory of any machine this runs on, and far
# enough below 2^63 / 8 that the tensor's constant dims and byte count cannot wrap.
MAX_ELEMENTS = 2**44
_TENSOR_TO_SHAPE = tvm.ir.Op.get("relax.tensor_to_shape")
_MESSAGE = value_check_message(
    "shape", f"a shape computed at run time holds over 2^{MAX_ELEMENTS.bit_length() - 1} elements")


@tvm.transform.module_pass(opt_level=0, name="CheckedShapes")
class CheckedShapes:  # pylint: disable=too-few-public-methods
    """Check each run-time shape's element count before it sizes a tensor."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """IRModule-level transformation."""
        rewriter = _Rewriter(mod)
        for g_var, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(g_var, rewriter.visit_expr(func))
        return rewriter.builder_.get()


@mutator
class _Rewriter(PyExprMutator):  # pylint: disable=abstract-method
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        sizes = call.args[0] if call.op.same_as(_TENSOR_TO_SHAPE) else None
        if sizes is None or isinstance(sizes, tvm.ir.GenericConst):
            return call
        counted = relax.op.maximum(relax.op.astype(sizes, "float32"), relax.const(1, "float32"))
        fits = relax.op.less_equal(relax.op.prod(counted), relax.const(float(MAX_ELEMENTS), "float32"))
        return relax.op.tensor_to_shape(require(self.builder_, sizes, self.builder_.emit(fits), _MESSAGE))
