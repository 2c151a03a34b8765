"""`LaneReduction`: matmul-like kernels with every output element's whole reduction in one
thread, for GPU targets whose threads are the SIMD lanes of a CPU core (lavapipe).

A CPU Vulkan driver runs a workgroup on one core, its invocations as vector lanes; it has no
cheap cross-lane communication (shared memory and barriers are memory round trips and
coroutine switches), and a load whose address differs between lanes becomes one scalar load
per lane. DLight's GEMV and Matmul rules split a reduction over the threads of a workgroup and
combine the parts through shared memory: right for a GPU, tens of times slower there.

Here consecutive threads take consecutive output columns of one row, so the weight row each
reads is its own and the other operand's element is the same for the whole workgroup (one
load, broadcast). The reduction is split by `vector` and factored (`rfactor`) so each thread
accumulates `vector` partial sums from vector loads, then adds them up. An elementwise
epilogue (a bias, a residual add) is computed by the same thread from the register.

Each row reads the weight again: right for decoding (one row per sequence). Tiling rows to
share weight loads (for prefill) needs a symbolic row count padded to whole tiles, whose
guarded loads made decoding slower on lavapipe; not done.
"""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target


def _static_extent(extent) -> int | None:
    return int(extent) if isinstance(extent, (int, tirx.IntImm)) else None


class LaneReduction(GPUScheduleRule):
    """One thread per output element (`threads` per workgroup along the innermost output
    axis), each reducing serially with `vector`-wide loads; kernels whose innermost output
    axis is not a static multiple of 8 are left to the other rules."""

    def __init__(self, threads: int = 64, vector: int = 4) -> None:
        self.threads = threads
        self.vector = vector

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        infos = try_inline_contiguous_spatial(sch, infos)
        if infos is None or not infos[0].is_reduction() or len(infos) > 2:
            return None
        if len(infos) == 2 and not infos[1].is_injective():
            return None
        reduction = infos[0]
        kinds = "".join(reduction.dom_kind())
        spatial = kinds.count("S")
        if kinds != "S" * spatial + "R" * (len(kinds) - spatial) or spatial in (0, len(kinds)):
            return None  # spatial axes, then reduction axes, nothing else
        # The innermost output axis: static and a multiple of the workgroup, so one workgroup
        # never straddles two rows (the other operand's loads stay uniform).
        columns = _static(reduction.iters[spatial - 1].dom)
        threads = next((t for t in (self.threads, 32, 16, 8) if columns and columns % t == 0), None)
        block = reduction.block_rv
        if threads is None or not _has_multiply(sch.get(block)):
            return None

        loops = sch.get_loops(block)
        sch.split(sch.fuse(*loops[:spatial]), factors=[None, threads])
        reduce = sch.fuse(*loops[spatial:])
        extent = _static(sch.get(reduce).extent)
        vector = self.vector if extent is not None and extent % self.vector == 0 else 1
        _, lanes = sch.split(reduce, factors=[None, vector])
        partial = sch.rfactor(lanes, factor_axis=0)
        bx, tx, outer, lanes = sch.get_loops(partial)
        sch.reverse_compute_at(block, tx, preserve_unit_loops=True)
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        # `vector` partial sums over `outer`, then their sum: unrolled, so the partial sums
        # are registers (a private array indexed by a loop variable lives in memory).
        sch.reorder(outer, lanes)
        sch.vectorize(lanes)
        sch.set_scope(partial, 0, "local")
        sch.decompose_reduction(partial, outer)
        for loop in sch.get_loops(block)[2:]:
            sch.unroll(loop)

        if len(infos) == 2:
            sch.reverse_compute_at(infos[1].block_rv, tx, preserve_unit_loops=True)
            sch.set_scope(block, 0, "local")
        return sch


def _static(extent: int | tirx.Expr) -> int | None:
    return int(extent) if isinstance(extent, (int, tirx.IntImm)) else None


def _has_multiply(block: s_tir.SBlock) -> bool:
    """Whether the reduction's update multiplies (a contraction, not a plain sum or max)."""
    found = []
    tvm_ffi.structural_walk(block.body, [(tirx.Mul, found.append)])
    return bool(found)
