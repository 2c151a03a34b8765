"""Reductions over a single element (every reduction axis of extent 1) as plain spatial blocks.

A matmul whose inner dimension is 1 (an outer product such as `k[:, None] @ v[None, :]`) or a
sum over an axis of size 1 legalizes to a reduction block with `T.init()` and a loop of
extent 1. DLight's `normalize_prim_func` drops that unit loop and its iteration variable but
keeps the `init`, leaving an all-spatial block that still reads its own output. TVM's
`reverse_compute_inline` then accepts it as a producer and substitutes the consumer into both
the `init` and the update: `out = c + mm` inlined into `mm = 0; mm = mm + a * b` becomes
`out = c; out = c + (out + a * b)`, which adds `c` twice (a bias or a carried state counted
double). Every GPU target schedules with DLight, so they all computed such kernels wrong.

Since the `init` of such a block runs in every block instance, it is folded into the update
(`mm = 0 + a * b`) before any rule sees the function: the block becomes a plain spatial one
that inlines correctly.
"""

from __future__ import annotations

from typing import Any

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight


def _unit_extent(iter_var: tirx.IterVar) -> bool:
    extent = iter_var.dom.extent
    return isinstance(extent, tirx.IntImm) and extent.value == 1


def _reads(expr: tirx.Expr, buffer: tirx.Buffer) -> bool:
    found = []
    tvm_ffi.structural_walk(
        expr, [(tvm.ir.TensorLoad, lambda load: found.append(load.source.same_as(buffer)))]
    )
    return any(found)


def _folded_update(init: tirx.Stmt, body: tirx.Stmt) -> tirx.Stmt:
    """The update with its reads of the accumulator replaced by the init value, or `init`
    followed by the update where the two are not single stores to the same element."""
    same_element = (
        isinstance(init, tirx.BufferStore)
        and isinstance(body, tirx.BufferStore)
        and init.buffer.same_as(body.buffer)
        and tvm_ffi.structural_equal(init.indices, body.indices)
    )
    if same_element:

        def initial(load: tvm.ir.TensorLoad) -> tirx.Expr:
            accumulator = load.source.same_as(body.buffer) and tvm_ffi.structural_equal(
                load.indices, body.indices
            )
            return init.value if accumulator else load

        value = tvm_ffi.structural_map(body.value, [(tvm.ir.TensorLoad, initial)])
        if not _reads(value, body.buffer):
            return tirx.BufferStore(body.buffer, value, body.indices)
    return tirx.SeqStmt([init, body])


def _fold_block(block: s_tir.SBlock) -> s_tir.SBlock:
    reduce = [iv for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    if block.init is None or not all(map(_unit_extent, reduce)):
        return block
    iter_vars = [
        tirx.IterVar(iv.dom, iv.var, tirx.IterVar.DataPar, iv.thread_tag)
        if iv.iter_type == tirx.IterVar.CommReduce else iv
        for iv in block.iter_vars
    ]
    return s_tir.SBlock(
        iter_vars,
        block.reads,
        block.writes,
        block.name_hint,
        _folded_update(block.init, block.body),
        None,
        block.alloc_buffers,
        block.match_buffers,
        block.annotations,
    )


def fold_unit_reductions(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with every reduction block whose reduction axes all have extent 1 rewritten as a
    spatial block computing `update(init)`; other blocks are unchanged."""
    return tvm_ffi.structural_map(func, [(s_tir.SBlock, _fold_block)])


class FoldUnitReductions(dlight.ScheduleRule):
    """A DLight rule that applies `rule` to the function with its unit reductions folded."""

    def __init__(self, rule: dlight.ScheduleRule) -> None:
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, tunable: bool) -> Any:
        return self.rule.apply(fold_unit_reductions(func), target, tunable)

    def is_target_available(self, target: tvm.target.Target) -> bool:
        return self.rule.is_target_available(target)
