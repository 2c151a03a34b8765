"""RecordUnalignedInputs: which parameters of `main` may come without 64-byte alignment. Goes
last in the pipeline (after VMShapeLower); changes nothing.

TVM compiles its kernels for 64-byte aligned buffers (aligned vector loads), so the runtime
copies every input numpy did not put on such a boundary (`runtime/tensors.py`; numpy puts a
large array 16 bytes past a page). A parameter whose only readers are the CPU library's
functions (`gimlet.cpu.*`, which load with unaligned instructions) and the VM's shape checks
needs no copy: a CNN's input goes straight to its first conv, and copying mobilenet_cnn's
400 KB batch took about 20 us of its 0.45 ms.

Views are not followed: a parameter reshaped before its first kernel, returned, or put in a
tuple counts as needing alignment.
"""

from __future__ import annotations

import tvm
from tvm import relax

UNALIGNED_READERS = ("gimlet.cpu.",)
"""Prefixes of the packed functions that read their tensors with unaligned loads."""
SHAPE_CHECKS = frozenset(("vm.builtin.check_tensor_info", "vm.builtin.match_shape"))
"""The VM's checks of a parameter's shape and dtype, which read no data."""


def _reads_unaligned(call: relax.Call) -> bool:
    if not isinstance(call.op, relax.ExternFunc):
        return False
    symbol = str(call.op.global_symbol)
    return symbol in SHAPE_CHECKS or symbol.startswith(UNALIGNED_READERS)


@relax.expr_functor.visitor
class _AlignedUses(relax.PyExprVisitor):
    """Collects the parameters used anywhere but as a direct argument of such a function."""

    def __init__(self, params: list[relax.Var]) -> None:
        self.params = set(params)
        self.aligned: set[relax.Var] = set()

    def visit_call_(self, call: relax.Call) -> None:
        unaligned = _reads_unaligned(call)
        for arg in call.args:
            if not (unaligned and isinstance(arg, relax.Var)):
                self.visit_expr(arg)

    def visit_var_(self, var: relax.Var) -> None:
        if var in self.params:
            self.aligned.add(var)


@tvm.transform.module_pass(opt_level=0, name="RecordUnalignedInputs")
class RecordUnalignedInputs:
    """After the pass ran, `unaligned[i]` says whether `main`'s parameter i may be unaligned."""

    def __init__(self) -> None:
        self.unaligned: tuple[bool, ...] = ()

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        main = mod["main"]
        params = list(main.params)
        uses = _AlignedUses(params)
        uses.visit_expr(main.body)
        self.unaligned = tuple(param not in uses.aligned for param in params)
        return mod
