"""Op times for placement's cost model: measured on the device (`OpTimer`) or read from
tuning records (`RecordedTimes`).

`OpTimer` builds each op alone (its tensor arguments become parameters with the same, possibly
symbolic, shapes; weights stay constants) through the target's whole pipeline, so the time
is that of the kernel the real build would use (a library call included), and run on the
device with symbolic dimensions at 1. One op signature is timed once per device.
Ops that can't be built or run alone get None (placement falls back to the roofline).

`RecordedTimes` turns the op alone into the kernels a tuning run would extract for the device's
target; when every one has a tuning record there, the op's time is the sum of their best
times. Records are made for whole fused kernels, so this knows the ops that form a kernel of
their own (a matmul, a softmax), not an add fused into a matmul's epilogue.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.s_tir import meta_schedule as ms

from .relax_passes.op_graph import OpNode

CompileOne = Callable[[tvm.IRModule, int], tvm.runtime.Executable]
"""Compiles a one-op module for the device at that index."""

ExtractKernels = Callable[[tvm.IRModule, int], Sequence[ms.ExtractedTask]]
"""The tuning tasks (kernels, with call counts) of a module built for the device at that index."""


class _PerSignature:
    """An op time source that builds each op alone (`_single_op_module`) and finds its time
    once per op signature and device, with `_seconds` (None: unknown)."""

    source: str

    def __init__(self) -> None:
        self._cache: dict[tuple[int, int], float | None] = {}

    def __call__(self, node: OpNode, device: int) -> float | None:
        built = _single_op_module(node.value)
        if built is None:
            return None
        mod, params = built
        key = (tvm_ffi.structural_hash(mod), device)
        if key not in self._cache:
            self._cache[key] = self._seconds(node, mod, params, device)
        return self._cache[key]

    def _seconds(self, node: OpNode, mod: tvm.IRModule, params: list[relax.TensorType],
                 device: int) -> float | None:
        raise NotImplementedError


class OpTimer(_PerSignature):
    """Times ops on `devices` (runtime devices, by build index) with `compile_one`."""

    source = "measured"

    def __init__(self, devices: Sequence[tvm.runtime.Device], compile_one: CompileOne,
                 min_repeat_ms: int = 5, symbolic_dim: int = 1):
        super().__init__()
        self.devices = list(devices)
        self.compile_one = compile_one
        self.min_repeat_ms = min_repeat_ms
        self.symbolic_dim = symbolic_dim
        self.failures: dict[tuple[str, int], str] = {}  # (op name, device) -> why not timed

    def _seconds(self, node, mod, params, device):
        try:
            return self._time(mod, params, device)
        except Exception as err:  # the op does not build or run alone on this target
            self.failures[node.name, device] = str(err).strip().splitlines()[-1][:200]
            return None

    def _time(self, mod: tvm.IRModule, params: list[relax.TensorType], device: int) -> float:
        dev = self.devices[device]
        executable = self.compile_one(mod, device)
        vm = relax.VirtualMachine(executable, dev)
        rng = np.random.default_rng(0)
        args = []
        for ty in params:
            shape = [int(d) if isinstance(d, tvm.tirx.IntImm) else self.symbolic_dim for d in ty.shape.values]
            dtype = str(ty.dtype)
            data = (rng.standard_normal(shape) if np.dtype(dtype).kind == "f" else np.zeros(shape))
            args.append(tvm.runtime.tensor(data.astype(dtype), dev))
        vm["main"](*args)  # warm-up: pipelines, caches
        timer = vm.time_evaluator("main", dev, number=1, repeat=3, min_repeat_ms=self.min_repeat_ms)
        return float(timer(*args).median)


class RecordedTimes(_PerSignature):
    """Op times from tuning records: `databases[i]` holds the records for the target of device
    `i` (None: no records for it); `extract` gives a one-op module's kernels for a device."""

    source = "tuning records"

    def __init__(self, databases: Sequence[ms.database.Database | None], targets: Sequence[tvm.target.Target],
                 extract: ExtractKernels):
        super().__init__()
        self.databases = list(databases)
        self.targets = list(targets)
        self.extract = extract

    def _seconds(self, node, mod, params, device):
        database = self.databases[device]
        if database is None:
            return None
        total = 0.0
        tasks = self.extract(mod, device)
        for task in tasks:
            record = database.query_tuning_record(task.dispatched[0], self.targets[device], task.task_name)
            if record is None or not record.run_secs:
                return None
            total += task.weight * sum(float(s) for s in record.run_secs) / len(record.run_secs)
        return total if tasks else None


def _single_op_module(call: relax.Expr | None) -> tuple[tvm.IRModule, list] | None:
    """`call` as the whole body of `main`, its tensor arguments made parameters; None when
    an argument is not a tensor, a tuple of them or a constant."""
    if not isinstance(call, relax.Call):
        return None
    params: list[relax.Var] = []

    def parameter(arg: relax.Expr) -> relax.Expr:
        if isinstance(arg, relax.Tuple):
            return relax.Tuple([parameter(field) for field in arg.fields])
        if isinstance(arg, relax.Var):
            ty = arg.ty
            if not isinstance(ty, relax.TensorType) or ty.shape is None or not hasattr(ty.shape, "values"):
                raise ValueError("not a tensor of known rank")
            params.append(relax.Var(f"arg{len(params)}", relax.TensorType(ty.shape, ty.dtype)))
            return params[-1]
        return arg

    try:
        args = [parameter(a) for a in call.args]
        bb = relax.BlockBuilder()
        with bb.function("main", params):
            with bb.dataflow():
                out = bb.emit_output(relax.Call(call.op, args, call.attrs, call.ty_args))
            bb.emit_func_output(out)
        mod = bb.finalize()
    except Exception:  # symbolic values it needs are not defined by its parameters, ...
        return None
    return mod, [p.ty for p in params]
