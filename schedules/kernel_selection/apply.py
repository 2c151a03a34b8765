"""Rewriting a module's op groups into chosen candidates: `rewrite_ops` and the build's pass,
`ApplyKernelSelection` (before the target's library passes), which applies a selection's
winners and the target's default kernels (`defaults`) alike. Op groups are formed first by
`grouping_passes`: the dispatch passes of the target's libraries (on the CPU
`DispatchCPULibrary`, whose matmul calls carry the epilogue they absorb); a library choice is
left as that call, any other is rewritten out of it (and so out of the library pass's reach
when it runs again)."""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ...relax_passes.library_dispatch import dispatch_passes
from ...targets import spec_for
from .candidates import Candidate, OpSignature
from .external import link_objects

Choose = Callable[[OpSignature], Candidate | None]


@mutator
class _Rewriter(PyExprMutator):  # pylint: disable=abstract-method
    choose: Choose = staticmethod(lambda sig: None)
    target: tvm.target.Target | None = None
    rewritten = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        sig = OpSignature.of_call(call, self.builder_.get())
        if sig is None or not all(_on(arg.ty, self.target) for arg in call.args):
            return call
        candidate = self.choose(sig)
        if candidate is None:
            return call
        self.rewritten += 1
        return candidate.rewrite(self.builder_, call)


def _on(ty: relax.TensorType, target: tvm.target.Target) -> bool:
    """The tensor has no virtual device, or one of `target`'s spec."""
    vdevice = getattr(ty, "vdevice", None)
    return vdevice is None or spec_for(vdevice.target) is spec_for(target)


def grouping_passes(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    """The passes that form a target's op groups (an op with the epilogue its library call
    would absorb), as `OpSignature.of_call` reads them."""
    return dispatch_passes(spec_for(target), grouping=True)


def rewrite_ops(mod: tvm.IRModule, choose: Choose, target: tvm.target.Target) -> tuple[tvm.IRModule, int]:
    """`mod` with every op group `choose` gives a candidate for rewritten into that candidate,
    and how many were."""
    mod = tvm.transform.Sequential(grouping_passes(target))(mod)
    rewriter = _Rewriter(mod)
    rewriter.choose = choose
    rewriter.target = target
    for g_var, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(g_var, rewriter.visit_expr(func))
    return link_objects(rewriter.builder_.get()), rewriter.rewritten


@tvm.transform.module_pass(opt_level=0, name="ApplyKernelSelection")
class ApplyKernelSelection:  # pylint: disable=too-few-public-methods
    """Rewrite each op group the selection has a winner for (on `target`) into that winner;
    `applied`: how many were. With none, the module is left as it came (not even grouped), so
    a build the defaults leave alone is the target's ordinary one."""

    def __init__(self, choose: Choose, target: tvm.target.Target) -> None:
        self.choose = choose
        self.target = target
        self.applied = 0

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewritten, self.applied = rewrite_ops(mod, self.choose, self.target)
        return rewritten if self.applied else mod
