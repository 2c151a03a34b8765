"""Fallback for any function whose blocks start with spatial axes (means, sums, ...)."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight import normalize_prim_func, try_inline
from tvm.target import Target

from .base import (
    CPURule,
    loop_product,
    schedule_spatial_block,
    vector_lanes,
    worth_parallel,
)


class RowReduction(CPURule):
    """Inline what can be inlined; then each reduction block runs its leading spatial axes in
    parallel (reduction loops serial inside) and each spatial block is vectorized."""

    def schedule(self, func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        blocks = normalize_prim_func(sch)
        if not blocks or any(not block.dom_kind().startswith("S") for block in blocks):
            return None
        for block in try_inline(sch, blocks):
            if block.is_injective():
                lanes = vector_lanes(sch, block.block_rv, target)
                schedule_spatial_block(sch, block.block_rv, lanes)
                continue
            kinds = block.dom_kind()
            num_spatial = len(kinds) - len(kinds.lstrip("S"))
            loops = sch.get_loops(block.block_rv)
            spatial = loops[:num_spatial]
            if worth_parallel(loop_product(sch, loops)):
                sch.parallel(sch.fuse(*spatial) if len(spatial) > 1 else spatial[0])
        return sch
