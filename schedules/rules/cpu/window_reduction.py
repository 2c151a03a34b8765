"""Sliding-window reductions: pooling, depthwise and other small-kernel convolutions."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight import normalize_prim_func
from tvm.s_tir.dlight.base import get_extent
from tvm.target import Target

from .base import (
    CPURule,
    loop_product,
    vector_lanes,
    vectorizable_axes,
    vectorize_innermost,
    worth_parallel,
)

# Reductions up to this many (constant) iterations per output count as windows.
MAX_WINDOW = 128


class WindowReduction(CPURule):
    """One reduction block over a small constant window (for example `SSSSRR` max pooling or
    `SSSSRRR` depthwise conv2d), with spatial producers (padding) and consumers (epilogues).

    The reduction loops move outside the innermost spatial axis, which is vectorized, so each
    window tap updates a vector of outputs; outer spatial axes run in parallel. Padding is
    computed per parallel iteration, the epilogue chain is inlined into its last block, which
    runs after each output row.
    """

    def schedule(self, func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        blocks = normalize_prim_func(sch)
        if not blocks:
            return None
        reductions = [block for block in blocks if not block.is_injective()]
        if len(reductions) != 1:
            return None
        reduction = reductions[0]
        kinds = reduction.dom_kind()
        num_spatial = len(kinds) - len(kinds.lstrip("S"))
        if num_spatial < 2 or kinds[num_spatial:].strip("R") or num_spatial == len(kinds):
            return None
        loops = sch.get_loops(reduction.block_rv)
        spatial, window = loops[:num_spatial], loops[num_spatial:]
        extents = [get_extent(sch, loop) for loop in spatial]
        window_size = loop_product(sch, window)
        innermost = get_extent(sch, spatial[-1])
        if window_size is None or window_size > MAX_WINDOW:
            return None
        if isinstance(innermost, int) and innermost < 4:
            return None
        index = blocks.index(reduction)
        consumers = blocks[index + 1 :]
        for consumer in consumers[:-1]:  # the epilogue chain collapses into its last block
            sch.compute_inline(consumer.block_rv)
        lanes = vector_lanes(sch, reduction.block_rv, target)
        iterations = loop_product(sch, loops)
        # Loops: [spatial outer...] [window...] [innermost spatial, vectorized].
        sch.reorder(*spatial[:-1], *window, spatial[-1])
        outer = spatial[:-2] if len(spatial) > 2 else spatial[:1]
        parallel_loop = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        if worth_parallel(iterations):
            sch.parallel(parallel_loop)
        for producer in blocks[:index][::-1]:
            sch.compute_at(producer.block_rv, parallel_loop, preserve_unit_loops=True)
            self._vectorize_under(sch, producer.block_rv, parallel_loop, lanes)
        if consumers:
            epilogue = consumers[-1].block_rv
            # One output row of the epilogue after each row of the reduction, when the
            # epilogue has the reduction's shape: computed at the row, an epilogue larger
            # than it (a pad) would never write the points that read no reduction output.
            if [get_extent(sch, loop) for loop in sch.get_loops(epilogue)] == extents:
                sch.reverse_compute_at(epilogue, spatial[-2], preserve_unit_loops=True)
            if vectorizable_axes(sch, epilogue) != 0:
                vectorize_innermost(sch, sch.get_loops(epilogue)[-1], lanes)
        # Vectorize before splitting off the init block, which copies the vectorized loop.
        vectorize_innermost(sch, sch.get_loops(reduction.block_rv)[-1], lanes)
        sch.decompose_reduction(reduction.block_rv, window[0])
        return sch

    @staticmethod
    def _vectorize_under(
        sch: s_tir.Schedule,
        block: s_tir.schedule.SBlockRV,
        parallel_loop: s_tir.schedule.LoopRV,
        lanes: int,
    ) -> None:
        """Vectorize the innermost loop of a block computed under `parallel_loop`."""
        loops = sch.get_loops(block)
        if (len(loops) > 1 and not sch.get(loops[-1]).same_as(sch.get(parallel_loop))
                and vectorizable_axes(sch, block) != 0):
            vectorize_innermost(sch, loops[-1], lanes)
