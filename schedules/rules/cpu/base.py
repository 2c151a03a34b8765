"""What the CPU schedule rules share: target checks, error handling, loop helpers."""

from __future__ import annotations

import math
import re

from tvm import s_tir, tirx
from tvm.s_tir.dlight import ScheduleRule
from tvm.s_tir.dlight.base import get_extent
from tvm.target import Target
from tvm.target.codegen import llvm_get_vector_width
from tvm.tirx.analysis import undefined_vars

# Loop nests with fewer iterations than this run serially: a parallel launch on TVM's
# thread pool costs a few microseconds, more than the work it would split.
MIN_PARALLEL_ITERATIONS = 1 << 14

# Math the LLVM backend can only call per element (libm): a vectorized loop calling them does
# not compile ("unknown intrinsic"), so functions using them stay scalar.
SCALAR_ONLY_MATH = ("T.sinh(", "T.cosh(", "T.fmod(")
# TVM's bfloat16 storage legalization (bfloat16 kept as uint16) cannot lower vector stores
# ("dtype mismatch on BufferStore"), so functions touching bfloat16 buffers stay scalar too.
SCALAR_ONLY_DTYPES = ('"bfloat16"',)

# What scheduling primitives raise when a rule's assumptions do not hold for a function.
SCHEDULE_ERRORS = (RuntimeError, ValueError, TypeError, IndexError)


class CPURule(ScheduleRule):
    """A rule for LLVM CPU targets that never fails the build.

    Subclasses implement `schedule`; when it returns None, or a scheduling primitive raises
    because the function is not what the rule expects, the rule does not apply and the next
    rule (or none) gets the function.
    """

    def apply(
        self, func: tirx.PrimFunc, target: Target, tunable: bool
    ) -> s_tir.Schedule | None:  # pylint: disable=unused-argument
        if not isinstance(func, tirx.PrimFunc) or "cpu" not in target.keys:
            return None
        try:
            return self.schedule(func, target)
        except SCHEDULE_ERRORS:
            return None

    def schedule(self, func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        """Schedule `func` for `target`, or return None when the rule does not apply."""
        raise NotImplementedError


def vector_lanes(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, target: Target) -> int:
    """How many of the elements `block` writes fit in the target's vector register; 1 when
    the function calls math or uses a dtype that cannot be vectorized."""
    if _is_scalar_only(sch):
        return 1
    writes = sch.get(block).writes
    dtype_bits = writes[0].source.dtype.bits if writes else 32
    vector_bits = llvm_get_vector_width(target)
    return max((vector_bits if vector_bits > 0 else 128) // dtype_bits, 1)


def _is_scalar_only(sch: s_tir.Schedule) -> bool:
    # The wheel's Python API has no TIR visitor; the printed function names every call/dtype.
    script = sch.mod.script()
    return any(name in script for name in SCALAR_ONLY_MATH + SCALAR_ONLY_DTYPES)


def loop_product(sch: s_tir.Schedule, loops: list[s_tir.schedule.LoopRV]) -> int | None:
    """Product of the loops' extents, or None when one of them is symbolic."""
    product = 1
    for loop in loops:
        extent = get_extent(sch, loop)
        if not isinstance(extent, int):
            return None
        product *= extent
    return product


def worth_parallel(iterations: int | None) -> bool:
    """Whether a nest of `iterations` (None: symbolic, assumed large) should run in parallel."""
    return iterations is None or iterations >= MIN_PARALLEL_ITERATIONS


def vectorize_innermost(
    sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV, lanes: int
) -> s_tir.schedule.LoopRV | None:
    """Split `loop` by `lanes` and vectorize the inner part; return the outer part.

    A loop no longer than `lanes` is vectorized whole (None returned); a loop of one
    iteration is left alone.
    """
    extent = get_extent(sch, loop)
    if isinstance(extent, int) and extent <= lanes:
        if extent > 1:
            sch.vectorize(loop)
        return None
    outer, inner = sch.split(loop, factors=[None, lanes])
    sch.vectorize(inner)
    return outer


def vectorizable_axes(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> int | None:
    """How many of `block`'s innermost loops may be vectorized: any (None), but
    - where the block opens with an assert (a run-time check of `relax_passes.checked_indexing`),
      whose condition LLVM cannot take as a vector, only the innermost loops that no iteration
      variable the condition reads is bound to;
    - past the innermost loop, none bound to an iteration variable that a read indexes through
      a division or a remainder (a channel shuffle's c % 2 * C / 2 + c // 2): a vector over such
      a variable computes each lane's address on its own. ShuffleNetV2's shuffles at 14x14, whose
      16-lane vectors crossed channels, took 83 us where onnxruntime's split, concat and
      transpose took 36."""
    body = sch.get(block).body
    first = body.seq[0] if isinstance(body, tirx.SeqStmt) else body
    asserted = isinstance(first, tirx.AssertStmt)
    checked = set(undefined_vars(first.condition)) if asserted else set()
    shuffled = _divided_iteration_vars(sch.get(block))
    if not asserted and not shuffled:
        return None
    loops = sch.get_loops(block)
    realize = sch.get(loops[-1]).body if loops else None
    if not isinstance(realize, s_tir.SBlockRealize):
        return 0 if asserted else None

    def bound_loop_vars(iteration_vars: set) -> set:
        values = [value for iv, value in zip(sch.get(block).iter_vars, realize.iter_values) if iv.var in iteration_vars]
        return {var for value in values for var in undefined_vars(value)}

    checked_loops, shuffled_loops = bound_loop_vars(checked), bound_loop_vars(shuffled)
    free = 0
    for loop in reversed(loops):
        loop_var = sch.get(loop).loop_var
        if loop_var in checked_loops or (free and loop_var in shuffled_loops):
            break
        free += 1
    return free


def _divided_iteration_vars(block: s_tir.SBlock) -> set:
    """`block`'s iteration variables that appear in a read's index with a division or remainder
    (the wheel's Python API has no TIR visitor: the printed index says)."""
    found = set()
    for region in block.reads:
        for extent in region.region:
            text = str(extent.min)
            if "//" not in text and "%" not in text:
                continue
            found.update(iv.var for iv in block.iter_vars if re.search(rf"\b{re.escape(iv.var.name)}\b", text))
    return found


def _vector_suffix(extents: list[int | None], lanes: int) -> tuple[int, int]:
    """(number of innermost loops to fuse, vector width) for a spatial loop nest.

    The shortest suffix of static loops whose product is a multiple of `lanes`; failing that,
    the one divisible by the widest power of two of at least 4. Vectors then never straddle
    an outer index, so every access stays a contiguous (or broadcast) vector. (0, 0) when
    no suffix fits.
    """
    best, product = (0, 0), 1
    for count, extent in enumerate(reversed(extents), start=1):
        if extent is None:
            break
        product *= extent
        width = lanes
        while width >= 4 and product % width:
            width //= 2
        if width == lanes:
            return count, width
        if width >= 4 and width > best[1]:
            best = (count, width)
    return best


def schedule_spatial_block(
    sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int
) -> None:
    """Loops of a spatial block: an innermost suffix vectorized, the rest fused and parallel.

    See `_vector_suffix` for the suffix, taken among the loops `vectorizable_axes` allows; when
    none fits (symbolic or odd inner extents), all those loops are fused so vectors still fill,
    with a scalar tail.
    """
    loops = sch.get_loops(block)
    if not loops:
        return
    extents = [get_extent(sch, loop) for loop in loops]
    static = [extent if isinstance(extent, int) else None for extent in extents]
    iterations = None if None in static else math.prod(static)
    free = vectorizable_axes(sch, block)
    vectorizable = static if free is None else static[len(static) - free:]
    count, width = _vector_suffix(vectorizable, lanes)
    if count == 0:
        count, width = len(vectorizable), lanes
    outer = loops[:len(loops) - count]
    if count:
        suffix = loops[-count:]
        inner = sch.fuse(*suffix) if len(suffix) > 1 else suffix[0]
        vector_outer = vectorize_innermost(sch, inner, width)
        outer += [] if vector_outer is None else [vector_outer]
    if outer and worth_parallel(iterations):
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
