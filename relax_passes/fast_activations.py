"""GELU, sigmoid and SiLU in TVM's fast (polynomial) erf, tanh and exp, for targets that ask
for fast math.

1. Put the pass after the library dispatch (a library that absorbs a GELU into its matmul's
   epilogue computes it itself) and before LegalizeOps, beside TVM's `FastMathTransform`:
   `library_passes` runs both where `TargetSpec.fast_math` is set.
2. It rewrites float32 `R.nn.gelu(x)`, `R.nn.gelu_tanh(x)`, `R.sigmoid(x)` and
   `R.nn.silu(x)` into the TE functions that LegalizeOps would emit, with `topi.fast_erf` /
   `topi.fast_tanh` / `topi.fast_exp` in place of `erf` / `tanh` / `exp`. `FastMathTransform`
   only sees `R.exp`, `R.erf` and `R.tanh` calls, so a GELU op (what `FuseGelu` makes of
   GPT-2's tanh approximation) kept libm's erf and tanh, which LLVM calls once per element:
   GPT-2's GELU kernels then took longer than its attention; EfficientNet-B0's sigmoids and
   SiLUs (those the CPU library's epilogues do not take) took 2 ns an element.
3. It does not handle other dtypes (the fast functions' polynomials are fitted for float32).
"""

from __future__ import annotations

import math

import tvm
from tvm import IRModule, relax, te, tirx, topi
from tvm.relax.expr_functor import PyExprMutator, mutator


def gelu(x: te.Tensor) -> te.Tensor:
    """0.5 x (1 + erf(x / sqrt(2))) with the fast erf."""
    half = tirx.const(0.5, x.dtype)
    return x * (half + topi.fast_erf(x * tirx.const(math.sqrt(0.5), x.dtype)) * half)


def gelu_tanh(x: te.Tensor) -> te.Tensor:
    """0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) with the fast tanh."""
    inner = tirx.const(math.sqrt(2.0 / math.pi), x.dtype) * x * (
        tirx.const(1.0, x.dtype) + tirx.const(0.044715, x.dtype) * x * x)
    return tirx.const(0.5, x.dtype) * x * (tirx.const(1.0, x.dtype) + topi.fast_tanh(inner))


def sigmoid(x: te.Tensor) -> te.Tensor:
    """1 / (1 + exp(-x)) with the fast exp (its argument clamped to +-88: no overflow)."""
    one = tirx.const(1.0, x.dtype)
    return one / (one + topi.fast_exp(-x))


def silu(x: te.Tensor) -> te.Tensor:
    """x * sigmoid(x) with the fast exp."""
    return x * sigmoid(x)


FAST_ACTIVATIONS = {"relax.nn.gelu": gelu, "relax.nn.gelu_tanh": gelu_tanh, "relax.sigmoid": sigmoid,
                    "relax.nn.silu": silu}
"""Relax op name -> its TE with fast math."""


@mutator
class _Rewriter(PyExprMutator):  # pylint: disable=abstract-method
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        compute = FAST_ACTIVATIONS.get(call.op.name) if isinstance(call.op, tvm.ir.Op) else None
        ty = call.args[0].ty if compute is not None else None
        if not isinstance(ty, relax.TensorType) or ty.dtype != "float32":
            return call
        return self.builder_.call_te(compute, call.args[0], primfunc_name_hint=call.op.name.split(".")[-1])


@tvm.transform.module_pass(opt_level=0, name="FastActivations")
def fast_activations(mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
    """Every Relax function's float32 GELUs through the fast erf / tanh."""
    rewriter = _Rewriter(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
    return rewriter.builder_.get()
