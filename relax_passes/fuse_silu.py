"""Recognise SiLU (swish) written out as x * sigmoid(x) and replace it with `R.nn.silu(x)`.

1. Put the pass after the canonicalization passes and before the CPU library's dispatch,
   which fuses `R.nn.silu` into the epilogue of the conv or matmul before it (as ReLU); it is
   one of `graph_fusion_passes()`. ONNX before opset 22 has no SiLU op, so exporters (torch's
   `nn.SiLU`, EfficientNet's and YOLO's activations) write `Mul(x, Sigmoid(x))`: without the
   rewrite, each became a sigmoid kernel and a multiply of its own over the whole activation.
2. It matches a float `multiply` whose operands are a tensor x and `sigmoid(x)` (either order)
   of the same shape. The sigmoid stays where something else reads it too.
3. It does not handle: swish with a slope (x * sigmoid(b * x)), hard-swish
   (x * relu6(x + 3) / 6), or products where x is broadcast.
"""

from __future__ import annotations

import tvm
from tvm import IRModule, relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .chain_matching import is_float_tensor, producer, rewrite_functions


@tvm.transform.module_pass(opt_level=0, name="FuseSiLU")
class FuseSiLU:  # pylint: disable=too-few-public-methods
    """Replace x * sigmoid(x) with `R.nn.silu(x)`."""

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        """IRModule-level transformation."""
        return rewrite_functions(mod, _SiLURewriter)


@mutator
class _SiLURewriter(PyExprMutator):  # pylint: disable=abstract-method
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.multiply" and is_float_tensor(call)):
            return call
        for x, gate in (call.args, call.args[::-1]):
            sigmoid = producer(gate, self.lookup_binding, "relax.sigmoid")
            if sigmoid is not None and sigmoid.args[0].same_as(x) and is_float_tensor(x) and x.ty.ndim == call.ty.ndim:
                analyzer = tvm.sym.Analyzer()
                if all(analyzer.can_prove_equal(a, b) for a, b in zip(x.ty.shape, call.ty.shape)):
                    return relax.op.nn.silu(x)
        return call
