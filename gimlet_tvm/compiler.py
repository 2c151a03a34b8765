"""`build`: ONNX model in, `CompiledModel` out, along one pipeline for every target."""

from __future__ import annotations

import json
import os
from typing import Sequence, Union

import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as generic_pipeline
from tvm.s_tir import dlight

from .errors import CompileError, GimletError, TargetUnavailableError, summary
from .frontend import InputShapes, ModelLike, import_model, load_model
from .runtime import CompiledModel
from .relax_passes.graph_fusion import graph_fusion_passes
from .schedules.records import ApplyRecords, RecordsDB
from .targets import TargetLike, TargetSpec, lookup

Targets = Union[TargetLike, Sequence[TargetLike]]


def canonicalize_passes() -> list[tvm.transform.Pass]:
    """Target-independent clean-up of the imported graph, before any target sees it."""
    return [
        relax.transform.CanonicalizeBindings(),
        relax.transform.FoldBatchnormToConv2D(),
        relax.transform.DecomposeOpsForInference(),
        relax.transform.FoldConstant(),
        relax.transform.EliminateCommonSubexpr(),
        relax.transform.DeadCodeElimination(),
    ]


def fusion_passes(spec: TargetSpec, target: tvm.target.Target) -> list[tvm.transform.Pass]:
    """Imported graph to fused TIR kernels: the kernels we build, and the ones tuning sees."""
    return [
        *canonicalize_passes(),
        *graph_fusion_passes(),
        *spec.library_passes(target),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]


def relax_pipeline(
    spec: TargetSpec, target: tvm.target.Target, tuned: ApplyRecords | None = None
) -> tvm.transform.Pass:
    """The whole Relax pipeline for one target; target specifics come from `spec` alone.

    `tuned` schedules the kernels that have tuning records; the default rules do the rest.
    """
    rules = list(spec.schedule_rules(target))
    passes = [
        *fusion_passes(spec, target),
        *([tuned] if tuned is not None else []),
        *([dlight.ApplyDefaultSchedule(*rules)] if rules else []),
        *generic_pipeline.dataflow_lower_passes(target),
        *generic_pipeline.finalize_passes(target),
    ]
    return tvm.transform.Sequential(passes, name="gimlet_tvm.relax_pipeline")


def resolve_target(targets: Targets) -> tuple[TargetSpec, tvm.target.Target]:
    """The single target to build for (several targets need the partitioner: not yet)."""
    if isinstance(targets, (list, tuple)):
        if len(targets) != 1:
            raise GimletError(
                f"building for several targets at once ({len(targets)} given) is not "
                "supported yet: cross-device partitioning is not implemented; pass one target"
            )
        targets = targets[0]
    spec, overrides = lookup(targets)
    return spec, spec.make_target(overrides)


def build(
    model: ModelLike,
    targets: Targets = "llvm",
    *,
    input_shapes: InputShapes | None = None,
    records: str | os.PathLike | None = None,
) -> CompiledModel:
    """Compile an ONNX model (path, `onnx.ModelProto` or bytes) for `targets`.

    `targets`: a registered name (`"llvm"`), a TVM target dict, or a one-element list.
    `input_shapes`: `{input name: shape}` fixing symbolic dims; others stay symbolic.
    `records`: a tuning-records directory (`gimlet_tvm.tune`); kernels without a record
    get the target's default schedules. `targets[0]["tuned_tasks"]` counts the tuned ones.
    """
    spec, target = resolve_target(targets)
    reason = spec.can_compile()
    if reason is not None:
        raise TargetUnavailableError(f"cannot compile for {spec.name} on this machine: {reason}")
    proto = load_model(model)
    mod, io = import_model(proto, input_shapes)
    tuned = ApplyRecords(RecordsDB(records), target) if records is not None else None
    with target, spec.codegen_hooks(target) as record:
        try:
            pipeline = relax_pipeline(spec, target, tuned)
            executable = tvm.compile(mod, target, relax_pipeline=pipeline)
        except GimletError:
            raise
        except Exception as err:  # TVM's passes and code generators raise many error types
            raise CompileError(f"compiling for {spec.name} failed: {summary(err)}") from err
    device_code = spec.check_code(executable.mod, record, target)
    built_for = {
        "name": spec.name,
        "target": json.loads(json.dumps(dict(target.export()), default=list)),
        "device_code": device_code.to_json(),
        "tuned_tasks": tuned.applied if tuned is not None else 0,
    }
    return CompiledModel(executable.mod, io, [built_for])
