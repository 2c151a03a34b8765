"""Kernel targets for multi-device modules: which target compiles each TIR kernel.

`AssignKernelTargets` goes after FuseTIR: LegalizeOps already tags the kernels of ops whose
tensors carry a `vdevice`, but kernels made by other passes (library dispatch, fast math,
importer `call_tir`s) carry no target and would be compiled for the host. Each `call_tir`'s
result device names its kernel's target; a kernel called from two devices is duplicated.

`PerTarget` runs target-specific TIR passes (schedule rules, tuning records) on each target's
kernels only, under that target, so a CPU rule never sees a GPU kernel and the reverse.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tvm
from tvm import relax

from .op_graph import tensor_types


def kernel_target(func: tvm.tirx.PrimFunc, default: tvm.target.Target | None) -> tvm.target.Target | None:
    """The target a kernel is tagged with, else `default`."""
    target = func.attrs.get("target") if func.attrs is not None else None
    return target if target is not None else default


@tvm.transform.module_pass(opt_level=0, name="AssignKernelTargets")
class AssignKernelTargets:
    """Tag every called TIR kernel with the target of the device its result lives on."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        call_tir = tvm.ir.Op.get("relax.call_tir")
        mod = mod.clone()
        tagged: dict[str, str] = {}  # kernel name -> target kind it now has
        copies: dict[tuple[str, str], tvm.ir.GlobalVar] = {}

        def retarget(call: relax.Call) -> relax.Call:
            if not call.op.same_as(call_tir):
                return call
            vdevice = next((t.vdevice for t in tensor_types(call.ty) if t.vdevice is not None), None)
            if vdevice is None or vdevice.target is None:
                return call
            target, kernel_gv = vdevice.target, call.args[0]
            kernel, name, kind = mod[kernel_gv], kernel_gv.name_hint, vdevice.target.kind.name
            tagged_before = kernel_target(kernel, None)
            current = tagged.get(name) or (tagged_before.kind.name if tagged_before else None)
            if current is None:
                mod[kernel_gv] = kernel.with_attr("target", target)
                tagged[name] = kind
                return call
            if current == kind:
                return call
            if (name, kind) not in copies:
                copies[name, kind] = tvm.ir.GlobalVar(f"{name}_{kind}")
                mod[copies[name, kind]] = kernel.with_attr("target", target)
            return relax.Call(call.op, [copies[name, kind], *call.args[1:]], call.attrs, call.ty_args)

        @relax.expr_functor.mutator
        class Retarget(relax.PyExprMutator):
            def visit_call_(self, call):  # pylint: disable=arguments-renamed
                return retarget(super().visit_call_(call))

        for gv, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                mod[gv] = Retarget().visit_expr(func)
        return mod


@tvm.transform.module_pass(opt_level=0, name="PerTarget")
class PerTarget:
    """Run `passes_for(target)` on the kernels of each target in `targets` (kernels without a
    target attribute belong to `default`)."""

    def __init__(self, targets: Sequence[tvm.target.Target], default: tvm.target.Target,
                 passes_for: Callable[[tvm.target.Target], Sequence[tvm.transform.Pass]]):
        self.targets = list(targets)
        self.default = default
        self.passes_for = passes_for

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = mod.clone()
        for target in self.targets:
            passes = list(self.passes_for(target))
            kernels = {
                gv: func for gv, func in mod.functions.items()
                if isinstance(func, tvm.tirx.PrimFunc)
                and kernel_target(func, self.default).kind.name == target.kind.name
            }
            if not passes or not kernels:
                continue
            with target:
                done = tvm.transform.Sequential(passes)(tvm.IRModule(kernels))
            for gv, func in done.functions.items():
                mod[gv] = func
        return mod
