"""PlaceOnDevices: put every op of `main` on a device and make the copies explicit.

Where it goes: after graph-level rewrites (canonicalization, graph fusion) and before the
targets' library dispatch and legalization, which then produce each op's kernel for its
device (LegalizeOps reads the device from the tensors' `vdevice`).

What it does: chooses devices with `placement.place` (capabilities, pins, graph-cut cost
model; op times from `timers` where they know them), declares the devices as the module's
`vdevice` list (the host first), gives every tensor its device and inserts one
`R.to_vdevice` per tensor and destination device (a tuple's fields are copied one by one). Weights
used off the host become parameters of `main` after its inputs, and a function
`gimlet_weights()` copies them to their devices, so a runtime copies them once, at load
(the VM would otherwise keep every constant on its first device).

Not handled: functions other than `main`, and control flow inside `main`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import tvm
from tvm import relax

from ..runtime.compiled_model import WEIGHTS_FUNCTION
from .op_graph import OpGraph, reads_metadata_only
from .placement import HOST, Device, OpTimes, Pins, Placement, place


@tvm.transform.module_pass(opt_level=0, name="PlaceOnDevices")
class PlaceOnDevices:
    """Place `main`'s ops on `devices` (index 0 is the host); the result is in `.placement`."""

    def __init__(self, devices: Sequence[Device], targets: Sequence[tvm.target.Target],
                 pins: Pins = Pins(), timers: Sequence[OpTimes] = ()):
        self.devices = list(devices)
        self.vdevices = [relax.VDevice(target, 0, "global") for target in targets]
        self.pins = pins
        self.timers = timers
        self.placement: Placement | None = None

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        func = mod["main"]
        self.placement = place(OpGraph.of(func), self.devices, self.pins, self.timers)
        device_of = {op.node.var: op.device for op in self.placement.ops}
        rest = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"},
                            attrs=mod.attrs)
        rest.update_global_info("vdevice", self.vdevices)
        mod = _Rewriter(rest, self.vdevices, device_of).run(func)
        return relax.transform.RealizeVDevice()(mod)


def _on(ty: Any, vdevice: relax.VDevice) -> Any:
    return relax.TensorType(ty.shape, ty.dtype, vdevice) if isinstance(ty, relax.TensorType) else ty


class _Rewriter:
    def __init__(self, mod: tvm.IRModule, vdevices: list, device_of: dict):
        self.bb = relax.BlockBuilder(mod)
        self.vdevices = vdevices
        self.device_of = device_of  # old binding var -> device index
        self.new: dict[relax.Var, relax.Expr] = {}  # old var -> its replacement
        self.location: dict[relax.Var, int] = {}  # new var -> device holding it
        self.copies: dict[tuple[relax.Var, int], relax.Var] = {}
        self.weights: dict[tuple[Any, int], relax.Var] = {}

    def run(self, func: relax.Function) -> tvm.IRModule:
        params = []
        for param in func.params:
            new = relax.Var(param.name, _on(param.ty, self.vdevices[HOST]))
            self.new[param], self.location[new] = new, HOST
            params.append(new)
        self._collect_weights(func)
        bb = self.bb
        with bb.function("main", [*params, *self.weights.values()], attrs=dict(func.attrs)):
            for block in func.body.blocks:
                self.copies.clear()  # dataflow variables do not outlive their block
                is_dataflow = isinstance(block, relax.DataflowBlock)
                with bb.dataflow() if is_dataflow else contextlib.nullcontext():
                    for binding in block.bindings:
                        self._emit(binding, is_dataflow)
            bb.emit_func_output(self._plain(func.body.body))
        if self.weights:
            with bb.function(WEIGHTS_FUNCTION, []):
                bb.emit_func_output(relax.Tuple([
                    relax.op.to_vdevice(const, self.vdevices[device])
                    for const, device in self.weights
                ]))
        return bb.finalize()

    def _collect_weights(self, func: relax.Function) -> None:
        for block in func.body.blocks:
            for binding in block.bindings:
                device = self.device_of.get(binding.var, HOST)
                if device == HOST or not isinstance(binding.value, relax.Call):
                    continue
                for const in _constants(binding.value.args):
                    key = (const, device)
                    if key not in self.weights:
                        name = f"weight{len(self.weights)}_{self.vdevices[device].target.kind.name}"
                        self.weights[key] = relax.Var(name, _on(const.ty, self.vdevices[device]))

    def _emit(self, binding: relax.Binding, is_dataflow: bool) -> None:
        var, value = binding.var, binding.value
        device = self.device_of.get(var)
        if isinstance(binding, relax.MatchCast):
            new_value = self._plain(value)
            new = self.bb.match_cast(new_value, binding.ty, var.name)
        else:
            if device is not None and isinstance(value, relax.Call) and not reads_metadata_only(value):
                new_value = relax.Call(value.op, [self._arg(a, device) for a in value.args],
                                       value.attrs, value.ty_args)
            elif device is not None and isinstance(value, relax.Tuple):
                new_value = self._arg(value, device)  # a tuple of tensors lives where they do
            else:
                new_value = self._plain(value)
            is_output = is_dataflow and not isinstance(var, relax.DataflowVar)
            new = (self.bb.emit_output if is_output else self.bb.emit)(new_value, name_hint=var.name)
        self.new[var] = new
        self.location[new] = device if device is not None else self._holder(new_value)

    def _holder(self, value: relax.Expr) -> int:
        """Where a projection or alias lives: with what it projects from."""
        if isinstance(value, relax.TupleGetItem):
            value = value.tuple_value
        return self.location.get(value, HOST) if isinstance(value, relax.Var) else HOST

    def _arg(self, arg: relax.Expr, device: int) -> relax.Expr:
        """`arg` as an op on `device` reads it: copied there if it lives elsewhere."""
        if isinstance(arg, relax.Tuple):
            return relax.Tuple([self._arg(field, device) for field in arg.fields])
        if isinstance(arg, tvm.ir.expr.Constant):
            return self.weights.get((arg, device), arg)
        arg = self._plain(arg)
        if not isinstance(arg, relax.Var) or not isinstance(arg.ty, relax.TensorType):
            return arg
        held = self.location.get(arg, HOST)
        if held == device:
            return arg
        key = (arg, device)
        if key not in self.copies:
            self.copies[key] = self.bb.emit(relax.op.to_vdevice(arg, self.vdevices[device]),
                                            name_hint=f"{arg.name}_to_{self.vdevices[device].target.kind.name}")
            self.location[self.copies[key]] = device
        return self.copies[key]

    def _plain(self, expr: relax.Expr) -> relax.Expr:
        """`expr` with the new variables substituted, no copies."""
        if isinstance(expr, relax.Var):
            return self.new.get(expr, expr)
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([self._plain(field) for field in expr.fields])
        if isinstance(expr, relax.TupleGetItem):
            return relax.TupleGetItem(self._plain(expr.tuple_value), expr.index)
        if isinstance(expr, relax.Call):
            return relax.Call(expr.op, [self._plain(a) for a in expr.args], expr.attrs, expr.ty_args)
        return expr


def _constants(args) -> list[tvm.ir.expr.Constant]:
    found = []
    for arg in args:
        if isinstance(arg, tvm.ir.expr.Constant) and isinstance(arg.ty, relax.TensorType):
            found.append(arg)
        elif isinstance(arg, relax.Tuple):
            found.extend(_constants(arg.fields))
    return found
