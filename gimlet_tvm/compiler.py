"""`build`: ONNX model in, `CompiledModel` out, along one pipeline for every target.

One target builds the whole model for it. Several targets build one executable for several
devices: `PlaceOnDevices` puts each op where the cost model says (the host CPU is device 0
and keeps inputs, outputs and anything no other target can run), then every target compiles
its own kernels and the Relax VM runs them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from typing import Any, Mapping, Sequence, Union

import onnx
import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as generic_pipeline
from tvm.s_tir import dlight
from tvm.s_tir import meta_schedule as ms

from .errors import CompileError, GimletError, TargetUnavailableError, summary
from .frontend import InputShapes, ModelLike, import_model, load_model
from .logs import TVMLog, quiet_tvm_logs
from .op_timing import OpTimer, RecordedTimes
from .relax_passes.checked_indexing import CheckedIndexing
from .relax_passes.fold_constants import FoldConstantsWithNumpy
from .relax_passes.fresh_outputs import RecordFreshOutputs
from .relax_passes.graph_fusion import graph_fusion_passes
from .relax_passes.kernel_targets import AssignKernelTargets, PerTarget
from .relax_passes.library_dispatch import layout_passes, library_passes
from .relax_passes.nan_safe_comparisons import NaNSafeComparisons
from .relax_passes.place_on_devices import PlaceOnDevices
from .relax_passes.placement import Device, Pins
from .relax_passes.planned_memory import RecordPlannedMemory
from .relax_passes.reshape_views import KEEP_DYNAMIC_RESHAPES
from .relax_passes.unaligned_inputs import RecordUnalignedInputs
from .runtime import CompiledModel
from .schedules.kernel_selection.choices import KernelSelection
from .schedules.kernel_selection.defaults import kernel_choices
from .schedules.rules import default_rules
from .schedules.tuning.records import ApplyRecords, RecordsDB
from .targets import DEFAULT_TARGET, DeviceCode, TargetLike, TargetSpec, host_spec, lookup, spec_for

Targets = Union[TargetLike, Sequence[TargetLike]]
BuildDevice = tuple[TargetSpec, tvm.target.Target]
logger = logging.getLogger(__name__)
INDEX_CHECKS_ENV = "GIMLET_TVM_INDEX_CHECKS"
"""Set to 0 to compile gathers and scatters without run-time bounds checks (as TVM does),
e.g. to measure what the checks cost; any other value, or none, keeps them."""


def index_checks() -> bool:
    """Whether builds check run-time indices (`relax_passes.checked_indexing`)."""
    return os.environ.get(INDEX_CHECKS_ENV, "1").strip() != "0"


def canonicalize_passes() -> list[tvm.transform.Pass]:
    """Target-independent clean-up of the imported graph, before any target sees it."""
    return [
        relax.transform.CanonicalizeBindings(),
        NaNSafeComparisons(),
        relax.transform.FoldBatchnormToConv2D(),
        relax.transform.DecomposeOpsForInference(),
        FoldConstantsWithNumpy(),
        relax.transform.FoldConstant(),
        relax.transform.EliminateCommonSubexpr(),
        relax.transform.DeadCodeElimination(),
    ]


def graph_passes() -> list[tvm.transform.Pass]:
    """The imported graph cleaned up and its patterns fused: what placement decides over."""
    return [*canonicalize_passes(), *graph_fusion_passes()]


def kernel_passes(
    devices: Sequence[BuildDevice], selection: tvm.transform.Pass | None = None,
    checked_indices: bool = True,
) -> list[tvm.transform.Pass]:
    """Graph (placed already, with several devices) to fused TIR kernels, each tagged with the
    target that compiles it; first each target's fixes of library kernels (`TargetSpec.
    fix_library_kernels`); `selection` (kernel selection's chosen kernels) runs after the
    layout passes (the CPU's blocked layout: blocked convs keep their kernels) and before the
    library passes. Sorts (`R.argsort`, which LegalizeOps does not lower) become TOPI's kernel
    for each op's target: the generic one on CPUs, the GPU one on targets keyed "gpu".
    Gathers and scatters with run-time indices get bounds-checked kernels unless
    `checked_indices` is False or `$GIMLET_TVM_INDEX_CHECKS` is 0."""
    return [
        *[_fix_library_kernels(spec) for spec, _ in devices],
        *graph_passes(),
        *[p for spec, _ in devices for p in layout_passes(spec)],
        *([selection] if selection is not None else []),
        *[p for spec, _ in devices for p in library_passes(spec)],
        FoldConstantsWithNumpy(),
        relax.backend.DispatchSortScan(),
        *([CheckedIndexing()] if checked_indices and index_checks() else []),
        relax.transform.LegalizeOps(KEEP_DYNAMIC_RESHAPES),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        *([AssignKernelTargets()] if len(devices) > 1 else []),
    ]


def _fix_library_kernels(spec: TargetSpec) -> tvm.transform.Pass:
    """`spec.fix_library_kernels` as a module pass."""
    return tvm.transform.module_pass(lambda mod, _ctx: spec.fix_library_kernels(mod), opt_level=0,
                                     name=f"FixLibraryKernels({spec.name})")


def fusion_passes(spec: TargetSpec, target: tvm.target.Target) -> list[tvm.transform.Pass]:
    """The kernels one target builds: the ones tuning sees."""
    return kernel_passes([(spec, target)])


def kernel_tasks(mod: tvm.IRModule, device: BuildDevice) -> list[ms.ExtractedTask]:
    """`mod`'s kernels for one device as MetaSchedule tuning tasks (with their call counts)."""
    spec, target = device
    with target:
        fused = tvm.transform.Sequential(fusion_passes(spec, target))(mod)
    return list(ms.relax_integration.extract_tasks(fused, target))


def device_pipeline(
    devices: Sequence[BuildDevice],
    tuned: ApplyRecords | None = None,
    memory: RecordPlannedMemory | None = None,
    selection: tvm.transform.Pass | None = None,
    checked_indices: bool = True,
    boundary: Sequence[tvm.transform.Pass] = (),
) -> tvm.transform.Pass:
    """The whole Relax pipeline; `devices[0]` compiles the kernels no device claimed.

    Each target's kernels get its default schedule rules; `tuned` schedules the first
    target's kernels that have tuning records; `memory` records the memory plan; `boundary`
    (last) what the runtime may skip at the call's boundary (`RecordUnalignedInputs`,
    `RecordFreshOutputs`); `checked_indices` as for `kernel_passes`. Target specifics come
    from the specs alone.
    """
    default = devices[0][1]

    def schedule(target: tvm.target.Target) -> list[tvm.transform.Pass]:
        rules = default_rules(spec_for(target), target)
        return [dlight.ApplyDefaultSchedule(*rules)] if rules else []

    passes = [
        *kernel_passes(devices, selection, checked_indices),
        *([PerTarget([default], default, lambda target: [tuned])] if tuned is not None else []),
        PerTarget([target for _, target in devices], default, schedule),
        *generic_pipeline.dataflow_lower_passes(default),
    ]
    for finalize in generic_pipeline.finalize_passes(default):
        passes.append(finalize)
        if memory is not None and finalize.info.name == "StaticPlanBlockMemory":
            passes.append(memory)
    passes.extend(boundary)
    return tvm.transform.Sequential(passes, name="gimlet_tvm.relax_pipeline")


def relax_pipeline(
    spec: TargetSpec, target: tvm.target.Target, tuned: ApplyRecords | None = None
) -> tvm.transform.Pass:
    """The pipeline of a one-target build."""
    return device_pipeline([(spec, target)], tuned)


def resolve_target(targets: Targets) -> BuildDevice:
    """The one target of a single-device build (tuning tunes one target)."""
    devices = resolve_devices(targets)
    if len(devices) != 1:
        raise GimletError(f"give one target here, not {len(devices)}")
    return devices[0]


def resolve_devices(targets: Targets) -> list[BuildDevice]:
    """The build's targets; with several, the host CPU first (added when not asked for)."""
    listed = list(targets) if isinstance(targets, (list, tuple)) else [targets]
    if not listed:
        raise GimletError("no target given")
    devices = []
    for entry in listed:
        spec, overrides = lookup(entry)
        devices.append((spec, spec.make_target(overrides)))
    names = [spec.name for spec, _ in devices]
    if len(set(names)) != len(names):
        raise GimletError(f"a target is given twice: {', '.join(names)}")
    if len(devices) > 1:
        host = host_spec()
        if host.name not in names:
            devices.insert(0, (host, host.make_target()))
        devices.sort(key=lambda device: device[0] is not host)
    return devices


def compile_alone(mod: tvm.IRModule, device: BuildDevice) -> tvm.runtime.Executable:
    """`mod` built for one device through its whole pipeline (no checks of the code)."""
    spec, target = device
    with target, spec.codegen_hooks(target):
        return tvm.compile(mod, target, relax_pipeline=relax_pipeline(spec, target))


def _placer(
    devices: Sequence[BuildDevice],
    asked: set[str],
    pins: Mapping[str, str] | None,
    device_facts: Mapping[str, Mapping[str, Any]] | None,
    costs: str,
    records: RecordsDB | None,
) -> PlaceOnDevices:
    if costs not in ("roofline", "measured"):
        raise GimletError(f"placement_costs must be 'roofline' or 'measured', not '{costs}'")
    timers = []
    if records is not None:
        timers.append(RecordedTimes([records.database(target) for _, target in devices],
                                    [target for _, target in devices],
                                    lambda mod, index: kernel_tasks(mod, devices[index])))
    if costs == "measured":
        for spec, _ in devices:
            reason = spec.can_run()
            if reason is not None:
                raise TargetUnavailableError(
                    f"measured placement costs need every device; {spec.name} cannot run here: {reason}")
        timers.append(OpTimer([spec.device() for spec, _ in devices],
                              lambda mod, index: compile_alone(mod, devices[index])))
    facts = dict(device_facts or {})
    unknown = set(facts) - {spec.name for spec, _ in devices}
    if unknown:
        raise GimletError(f"device_facts for targets not in the build: {', '.join(sorted(unknown))}")
    placement_devices = [
        Device(spec, dataclasses.replace(spec.perf_facts(), **facts.get(spec.name, {})),
               placeable=spec.name in asked)
        for spec, _ in devices
    ]
    return PlaceOnDevices(placement_devices, [target for _, target in devices],
                          Pins(dict(pins or {})), timers)


@contextlib.contextmanager
def _compile_errors(devices: Sequence[BuildDevice]):
    """TVM's passes and code generators raise many error types: one CompileError for them."""
    try:
        yield
    except GimletError:
        raise
    except Exception as err:
        names = "+".join(spec.name for spec, _ in devices)
        raise CompileError(f"compiling for {names} failed: {summary(err)}") from err


def _place(
    mod: tvm.IRModule, devices: list[BuildDevice], placer: PlaceOnDevices
) -> tuple[tvm.IRModule, list[BuildDevice]]:
    """The module placed across `devices`, and the devices it uses. When every op lands on one
    device the model is built for that device alone, exactly as a one-target build."""
    host = devices[0][1]
    with host, _compile_errors(devices):
        prepared = tvm.transform.Sequential(graph_passes())(mod)
        placed = placer(prepared)
    used = sorted({op.device for op in placer.placement.ops})
    if len(used) == 1 and not placer.placement.copies:
        return prepared, [devices[used[0]]]
    return placed, devices


def build(
    model: ModelLike,
    targets: Targets = DEFAULT_TARGET,
    *,
    input_shapes: InputShapes | None = None,
    records: str | os.PathLike | None = None,
    pins: Mapping[str, str] | None = None,
    device_facts: Mapping[str, Mapping[str, Any]] | None = None,
    placement_costs: str = "roofline",
    selection: KernelSelection | None = None,
) -> CompiledModel:
    """Compile an ONNX model (path, `onnx.ModelProto` or bytes) for `targets`.

    `targets`: a registered name (`"llvm"`), a TVM target dict, or a list of them: with
    several, each op goes to the device where the modelled latency is least
    (`CompiledModel.placement()` says where and why).
    `input_shapes`: `{input name: shape}` fixing symbolic dims; others stay symbolic.
    `records`: a tuning-records directory (`gimlet_tvm.tune`) for the first target; kernels
    without a record get the target's default schedules (`targets[0]["tuned_tasks"]`). With
    several targets, placement takes op times from the records where they have them.
    `pins`: `{ONNX op type or node name: target name}` puts ops on a device by hand (an op the
    device cannot run falls back). `device_facts`: `{target name: {PerfFacts field: value}}`
    overrides the placement cost model's roofline of a device. `placement_costs="measured"`
    times every op alone on every device (slower builds; the devices must be here) where the
    records have no time for it.
    `selection`: the kernels `gimlet-tvm select` (or `tune`) chose for the first target; by
    default the one stored in `records`, if any (`targets[0]["selected_kernels"]`: op groups
    it rewrote). Op groups without a selection's entry get the target's default kernels, a
    built-in rule (`TargetSpec.default_kernel`; `targets[0]["default_kernels"]`: op groups it
    rewrote; `$GIMLET_TVM_DEFAULT_KERNELS=0` turns it off).

    Gathers and scatters check their run-time indices: an index outside its axis raises
    `InputError` when the model runs (see `$GIMLET_TVM_INDEX_CHECKS`).

    TVM's C++ log lines stay off stderr (`gimlet_tvm.logs`); the one that matters, indices
    compiled without bounds checks (only with the checks turned off), becomes a warning of
    ours (logger `gimlet_tvm`).
    """
    with quiet_tvm_logs() as tvm_log:
        compiled, proto = _build(model, targets, input_shapes, records, pins, device_facts,
                                 placement_costs, selection)
    if not index_checks():
        _warn_unchecked_indices(proto, tvm_log)
    return compiled


def _warn_unchecked_indices(proto: onnx.ModelProto, tvm_log: TVMLog) -> None:
    """TVM lowers ONNX Gather to `take` in "fast" mode, without bounds checks (and logs
    "Fast mode segfaults when there are out-of-bounds indices"): name the Gathers whose
    indices are computed at run time, where onnxruntime would check them."""
    if not tvm_log.matching("out-of-bounds indices"):
        return
    graph = proto.graph
    constants = {t.name for t in graph.initializer}
    constants |= {out for node in graph.node if node.op_type == "Constant" for out in node.output}
    gathers = [node.name or node.output[0] for node in graph.node
               if node.op_type == "Gather" and node.input[1] not in constants]
    what = (f"Gather node{'s' if len(gathers) > 1 else ''} {', '.join(gathers[:5])}"
            f"{', ...' if len(gathers) > 5 else ''}" if gathers else "an indexing op (take)")
    logger.warning(f"{what}: indices are not bounds-checked at run time; an index outside the "
                   "gathered axis (e.g. a token id past the vocabulary) reads out-of-bounds memory "
                   "(wrong values or a crash) instead of raising an error")


def _build(
    model: ModelLike,
    targets: Targets,
    input_shapes: InputShapes | None,
    records: str | os.PathLike | None,
    pins: Mapping[str, str] | None,
    device_facts: Mapping[str, Mapping[str, Any]] | None,
    placement_costs: str,
    selection: KernelSelection | None,
) -> tuple[CompiledModel, onnx.ModelProto]:
    """`build`'s work: the compiled model, and the ONNX model it was compiled from."""
    devices = resolve_devices(targets)
    for spec, _ in devices:
        reason = spec.can_compile()
        if reason is not None:
            raise TargetUnavailableError(f"cannot compile for {spec.name} on this machine: {reason}")
    if len(devices) == 1 and (pins or device_facts or placement_costs != "roofline"):
        raise GimletError("pins, device_facts and placement_costs need several targets to place ops on")
    proto = load_model(model)
    mod, io = import_model(proto, input_shapes, runs_here=devices[0][0].runs_here())
    database = RecordsDB(records) if records is not None else None
    placement = None
    if len(devices) > 1:
        given = targets if isinstance(targets, (list, tuple)) else [targets]
        placer = _placer(devices, {lookup(entry)[0].name for entry in given}, pins, device_facts,
                         placement_costs, database)
        names = [spec.name for spec, _ in devices]
        mod, devices = _place(mod, devices, placer)
        placement = placer.placement.to_json(names)
    spec, target = devices[0]
    tuned = ApplyRecords(database, target) if database is not None else None
    if selection is None and records is not None:
        selection = KernelSelection.load(records, target)
    chosen, defaults = kernel_choices(selection, target)
    memory, unaligned, fresh = RecordPlannedMemory(), RecordUnalignedInputs(), RecordFreshOutputs()
    with target, contextlib.ExitStack() as stack:
        codegen = [stack.enter_context(spec.codegen_hooks(t)) for spec, t in devices]
        with _compile_errors(devices):
            pipeline = device_pipeline(devices, tuned, memory, chosen, boundary=(unaligned, fresh))
            executable = tvm.compile(mod, target, relax_pipeline=pipeline)
    default_kernels = defaults.chosen if defaults is not None else 0
    built_for = []
    for index, ((spec, target), record) in enumerate(zip(devices, codegen)):
        if len(devices) > 1 and not record.kernels:
            device_code = DeviceCode("no kernels placed on this device", (), "-")
        else:
            device_code = spec.check_code(executable.mod, record, target)
        built_for.append({
            "name": spec.name,
            # What the runtime needs to run it, without the target registry (runtime/libraries.py).
            "device_type": spec.device_type,
            "runtime_libraries": list(spec.runtime_libraries),
            "arch": spec.arch,
            "target": json.loads(json.dumps(dict(target.export()), default=list)),
            "device_code": device_code.to_json(),
            "tuned_tasks": tuned.applied if tuned is not None and index == 0 else 0,
            "selected_kernels": chosen.applied - default_kernels if chosen is not None and index == 0 else 0,
            "default_kernels": default_kernels if index == 0 else 0,
            "planned_memory": memory.bytes_per_device.get(index, 0),
        })
    # Inputs live on the first device: which of them its kernels read without alignment; and
    # which outputs the caller may own without a copy.
    built_for[0]["unaligned_inputs"] = list(unaligned.unaligned[:len(io.inputs)])
    built_for[0]["fresh_outputs"] = list(fresh.fresh)
    return CompiledModel(executable.mod, io, built_for, placement=placement, linker=devices[0][0].linker), proto
