"""Default (untuned) schedule rules for GPU targets: DLight's, most specific first."""

from __future__ import annotations

from typing import Sequence

from tvm.s_tir import dlight

from .lane_reduction import LaneReduction
from .opaque_kernels import OpaqueKernels
from .unit_reductions import FoldUnitReductions

# `Fallback` schedules anything left.
DLIGHT_GPU_RULES = {
    "Matmul": dlight.gpu.Matmul,
    "GEMV": dlight.gpu.GEMV,
    "Reduction": dlight.gpu.Reduction,
    "GeneralReduction": dlight.gpu.GeneralReduction,
    "Fallback": dlight.gpu.Fallback,
}
# Rules a target asks for by name (`TargetSpec.schedule_rules_first`), tried before the defaults.
OPT_IN_GPU_RULES = {"LaneReduction": LaneReduction}


def gpu_rules(without: Sequence[str] = (), first: Sequence[str] = ()) -> list:
    """The opt-in rules named in `first`, then DLight's default GPU rules less those named in
    `without` (known to fail a target).

    Each sees the kernel with its single-element reductions folded (`FoldUnitReductions`):
    DLight inlines an epilogue into such a reduction's init and update both. `OpaqueKernels`
    comes last: it puts on the device the kernels DLight leaves to the host (TOPI's generic
    extern ops), or refuses them.
    """
    chosen = [OPT_IN_GPU_RULES[name] for name in first]
    chosen += [rule for name, rule in DLIGHT_GPU_RULES.items() if name not in without]
    rules = [FoldUnitReductions(rule()) for rule in chosen]
    return [*rules, OpaqueKernels()]
