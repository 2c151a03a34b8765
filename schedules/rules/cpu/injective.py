"""Elementwise and other injective functions (bias, activations, transposes, reshapes)."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight import normalize_prim_func, try_inline
from tvm.target import Target

from .base import CPURule, schedule_spatial_block, vector_lanes


class Injective(CPURule):
    """Inline every block it can, then give each remaining block parallel outer loops and a
    vectorized inner loop. Applies when no block reduces."""

    def schedule(self, func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        blocks = normalize_prim_func(sch)
        if not blocks or not all(block.is_injective() for block in blocks):
            return None
        for block in try_inline(sch, blocks):
            lanes = vector_lanes(sch, block.block_rv, target)
            schedule_spatial_block(sch, block.block_rv, lanes)
        return sch
