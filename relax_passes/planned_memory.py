"""RecordPlannedMemory: how many bytes a run allocates on each device, read from the memory
plan. Goes right after StaticPlanBlockMemory; changes nothing.

Counts `alloc_storage` (planned, shared buffers) and `alloc_tensor` (unplanned) per virtual
device index. Weights are not counted (they are loaded once, not allocated per run). A size
that depends on a symbolic dimension makes that device's total None (unknown until run).
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax


@tvm.transform.module_pass(opt_level=0, name="RecordPlannedMemory")
class RecordPlannedMemory:
    """After the pass ran, `bytes_per_device[i]` is device i's total (None if dynamic)."""

    def __init__(self) -> None:
        self.bytes_per_device: dict[int, int | None] = {}

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        storage = tvm.ir.Op.get("relax.memory.alloc_storage")
        tensor = tvm.ir.Op.get("relax.builtin.alloc_tensor")
        totals = self.bytes_per_device

        def count(device_arg: relax.Expr, nbytes: int | None) -> None:
            device = int(getattr(device_arg, "value", device_arg))
            if device not in totals or totals[device] is not None:
                totals[device] = None if nbytes is None else totals.get(device, 0) + nbytes

        def visit(expr: relax.Expr) -> None:
            if not isinstance(expr, relax.Call):
                return
            if expr.op.same_as(storage):
                count(expr.args[1], _static_size(expr.args[0], "uint8"))
            elif expr.op.same_as(tensor):
                count(expr.args[2], _static_size(expr.args[0], str(expr.args[1].value)))

        for func in mod.functions.values():
            if isinstance(func, relax.Function):
                relax.analysis.post_order_visit(func, visit)
        return mod


def _static_size(shape: relax.Expr, dtype: str) -> int | None:
    if not isinstance(shape, relax.ShapeExpr):
        return None
    dims = [int(d) if isinstance(d, tvm.tirx.IntImm) else None for d in shape.values]
    if None in dims:
        return None
    return math.prod(dims) * np.dtype(dtype).itemsize
