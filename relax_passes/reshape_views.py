"""Reshapes with run-time dims stay views of their input instead of becoming copy kernels.

1. Use it in LegalizeOps: `LegalizeOps(customize_legalize_map=KEEP_DYNAMIC_RESHAPES)`.
2. `R.reshape` whose input or output shape has a dim that is not a constant is left as it is;
   VMBuiltinLower later makes it `vm.builtin.reshape`, a view sharing the input's storage
   (StaticPlanBlockMemory knows a reshape's output aliases its input). Relax tensors are
   compact, so a reshape never needs to move data.
3. Why: TOPI's reshape kernel maps each output index to the input's through a division and a
   remainder per dim; with run-time dims those stay signed divisions wrapped in selects, which
   LLVM took 65 s to compile for one 4-D -> 2-D reshape (ONNX ReduceSum with axes given at run
   time and keepdims=0), besides copying at run time what is a view.
4. It does not handle reshapes with constant shapes: they legalize as before (FoldConstant
   folds constant ones; RewriteDataflowReshape turns those inside dataflow blocks into views).
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

_RESHAPE = "relax.reshape"
_LEGALIZE_RESHAPE = tvm.ir.Op.get(_RESHAPE).get_attr("FLegalize")


def _static(ty: relax.Type) -> bool:
    """Whether a tensor type has a known shape of constant dims only."""
    shape = getattr(ty, "shape", None)
    return isinstance(shape, relax.ShapeExpr) and all(isinstance(d, tirx.IntImm) for d in shape.values)


def legalize_reshape(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """TOPI's kernel for a reshape of constant shapes; the call unchanged (a view) otherwise."""
    if _static(call.args[0].ty) and _static(call.ty):
        return _LEGALIZE_RESHAPE(bb, call)
    return call


KEEP_DYNAMIC_RESHAPES = {_RESHAPE: legalize_reshape}
