"""Row-wise normalizations: softmax, layer norm, RMS norm.

The shape of DLight's CPU `Reduction` schedule (every block computed under the parallel
leading spatial axes, elementwise steps vectorized), with one difference: each reduction over
a static innermost axis of at least two vectors is first factored (`rfactor`) into one partial
sum (or max) per vector lane, accumulated with vector instructions, then added up. DLight
leaves such a reduction scalar, one dependent add per element: the add's latency (about four
cycles) then bounds it, and a layer norm's two reductions took most of its time. rfactor has
to come before the blocks are moved under the shared loop (DLight's note: the primitive wants
the block alone under its loops), so this rule does both steps itself.

Not handled (left scalar, as DLight does): reductions over a symbolic or short axis, over
several axes, or whose extent is not a multiple of the vector width.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight import normalize_prim_func
from tvm.s_tir.dlight.base import get_extent
from tvm.target import Target

from .base import CPURule, vector_lanes


class Normalization(CPURule):
    """Functions of reduction (S..SR) and elementwise (S..S) blocks sharing their leading
    spatial axes, the last one elementwise (softmax, layer norm, RMS norm)."""

    def schedule(self, func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or len(infos) < 2 or not infos[-1].is_injective():
            return None
        if all(info.is_injective() for info in infos):
            return None
        kinds = [info.dom_kind() for info in infos]
        if any(not kind.startswith("S") for kind in kinds):
            return None
        leading = min(len(kind) - len(kind.lstrip("S")) for kind in kinds)
        lanes = vector_lanes(sch, infos[-1].block_rv, target)

        partial_sums = [
            factored for info in infos[:-1] if not info.is_injective()
            for factored in [_lane_partial_sums(sch, info.block_rv, lanes)] if factored is not None
        ]
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        loops = sch.get_loops(blocks[-1])
        spatial = sch.fuse(*loops[:leading]) if leading > 1 else loops[0]
        sch.parallel(spatial)
        for block in reversed(blocks[:-1]):
            sch.compute_at(block, spatial, preserve_unit_loops=True)

        partial_names = {sch.get(block).name_hint for block in partial_sums}
        for block in blocks:
            if sch.get(block).name_hint in partial_names:
                _vectorize_partial_sums(sch, block)
            elif _is_reduction(sch, block):
                _unroll_innermost(sch, block, lanes)
            else:
                _vectorize_innermost(sch, block, lanes)
        return sch


def _is_reduction(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> bool:
    return any(var.iter_type == tirx.IterVar.CommReduce for var in sch.get(block).iter_vars)


def _lane_partial_sums(
    sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int
) -> s_tir.schedule.SBlockRV | None:
    """Split the block's one (innermost) reduction loop by `lanes` and factor the lanes out:
    the new block accumulates `lanes` partial results, the old one adds them up. None (and
    nothing changed) where the reduction is not a single static multiple of two vectors."""
    reduce_axes = [var for var in sch.get(block).iter_vars if var.iter_type == tirx.IterVar.CommReduce]
    if lanes < 2 or len(reduce_axes) != 1:
        return None
    innermost = sch.get_loops(block)[-1]
    extent = get_extent(sch, innermost)
    if not isinstance(extent, int) or extent % lanes or extent < 2 * lanes:
        return None
    _, lane = sch.split(innermost, factors=[None, lanes])
    return sch.rfactor(lane, factor_axis=len(sch.get(block).iter_vars) - 1)


def _vectorize_partial_sums(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> None:
    """Under the shared loop, compute_at gave the partial-sum block its loops in the order of
    its iterators (lanes, then reduction steps): swapped, each step updates all lanes as one
    vector (the first step's initialisation too)."""
    lane, steps = sch.get_loops(block)[-2:]
    sch.reorder(steps, lane)
    sch.vectorize(lane)


def _unroll_innermost(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int) -> None:
    """A reduction left scalar: its innermost loop in chunks of `lanes`, unrolled (DLight's
    choice: LLVM would otherwise unroll the whole loop)."""
    innermost = sch.get_loops(block)[-1]
    extent = get_extent(sch, innermost)
    if isinstance(extent, int) and extent <= lanes:
        return
    _, chunk = sch.split(innermost, factors=[None, lanes])
    sch.annotate(chunk, ann_key="pragma_auto_unroll_max_step", ann_val=lanes)
    sch.annotate(chunk, ann_key="pragma_unroll_explicit", ann_val=1)


def _vectorize_innermost(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int) -> None:
    """An elementwise block: its innermost loop as vectors of `lanes` (a shorter static loop
    as one vector)."""
    loops = sch.get_loops(block)
    if len(loops) <= 1 or lanes < 2:
        return
    extent = get_extent(sch, loops[-1])
    if isinstance(extent, int) and extent <= lanes:
        if extent >= 2:
            sch.vectorize(loops[-1])
        return
    _, vector = sch.split(loops[-1], factors=[None, lanes])
    sch.vectorize(vector)
