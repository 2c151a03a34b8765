"""GPU kernels for the TIR no schedule rule takes: TOPI's generic (CPU) extern ops.

TOPI's generic scans (`cumsum_generic`, `cumprod_generic`) are opaque blocks built with the IR
builder: a `parallel` loop over the rows, each scanned serially. DLight's rules leave such a
function unscheduled, and TVM then compiles it as host code: the CPU dereferences the device
buffer handles as if they were data (on Vulkan a `VulkanBuffer*`), corrupting the runtime's
memory. The conformance worker crashed, timed out or reported garbage device ids.

`OpaqueKernels`, the last GPU rule, puts every such function on the device: each outermost
`parallel` loop becomes a grid of threads (one iteration per thread) where the function does
all its work inside such loops, else the whole body runs on one device thread. A function that
calls a host library function (`tvm.contrib.sort.argsort`, what TOPI's generic argsort calls;
sorts reach GPUs as TOPI's GPU sort through DispatchSortScan) cannot run on a GPU: it is refused
at compile time, naming the function, and so is any other function left without threads.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.s_tir.dlight.base import max_threads_per_block


class UnsupportedOnDeviceError(RuntimeError):
    """A kernel the device cannot run (raised while scheduling, so at compile time)."""


_PACKED_CALLS = ("tirx.tvm_call_packed", "tirx.tvm_call_cpacked", "tirx.tvm_call_trace_packed")


def _walk(node: object, kind: type) -> list:
    found: list = []
    tvm_ffi.structural_walk(node, [(kind, found.append)])
    return found


def _launches_threads(func: tirx.PrimFunc) -> bool:
    loops = [f for f in _walk(func.body, tirx.For) if f.kind == tirx.ForKind.THREAD_BINDING]
    attrs = [a for a in _walk(func.body, tirx.AttrStmt) if a.attr_key == "thread_extent"]
    return bool(loops or attrs)


def _host_calls(func: tirx.PrimFunc) -> list[str]:
    calls = [c for c in _walk(func.body, tvm.ir.Call)
             if isinstance(c.op, tvm.ir.Op) and c.op.name in _PACKED_CALLS]
    return sorted({str(c.args[0].value) for c in calls})


def _launch(var: tirx.Var, tag: str, extent: int | tirx.Expr, body: tirx.Stmt) -> tirx.Stmt:
    """`body` run by `extent` threads along `tag` (what `T.launch_thread` builds)."""
    axis = tirx.IterVar(tvm.ir.Range(0, extent), var, tirx.IterVar.ThreadIndex, tag)
    return tirx.AttrStmt(axis, "thread_extent", extent, body)


def _thread(tag: str) -> tirx.Var:
    return tirx.Var(tag.replace(".", "_"), "int32")


def _grid(loop: tirx.For, threads: int) -> tirx.Stmt:
    """A `parallel` loop as a grid of `threads`-wide workgroups, one iteration per thread."""
    dtype = loop.loop_var.ty.dtype
    extent = loop.extent
    if isinstance(extent, tirx.IntImm):
        threads = min(threads, max(int(extent.value), 1))
    tx, bx = _thread("threadIdx.x"), _thread("blockIdx.x")
    index = tirx.Cast(dtype, bx) * threads + tirx.Cast(dtype, tx)
    once = tirx.For(loop.loop_var, loop.min + index, tirx.const(1, dtype), tirx.ForKind.SERIAL,
                    loop.body)
    blocks = tirx.Cast("int32", tirx.ceildiv(extent, tirx.const(threads, dtype)))
    body = _launch(tx, "threadIdx.x", threads, tirx.IfThenElse(index < extent, once, None))
    return _launch(bx, "blockIdx.x", blocks, body)


def _serial(loop: tirx.For) -> tirx.For:
    return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, loop.body)


def _on_one_thread(block: s_tir.SBlock) -> s_tir.SBlock:
    body = tvm_ffi.structural_map(
        block.body,
        [(tirx.For, lambda f: _serial(f) if f.kind == tirx.ForKind.PARALLEL else f)],
    )
    for tag in ("threadIdx.x", "blockIdx.x"):
        body = _launch(_thread(tag), tag, 1, body)
    return _with_body(block, body)


def _with_body(block: s_tir.SBlock, body: tirx.Stmt) -> s_tir.SBlock:
    return s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body,
                        block.init, block.alloc_buffers, block.match_buffers, block.annotations)


def _stores(node: object) -> int:
    return len(_walk(node, tirx.BufferStore))


def _parallel_loops_do_all_work(stmt: tirx.Stmt) -> bool:
    """Whether `stmt` has `parallel` loops, none inside another, that do all its stores."""
    loops = [f for f in _walk(stmt, tirx.For) if f.kind == tirx.ForKind.PARALLEL]
    nested = any(g.kind == tirx.ForKind.PARALLEL for f in loops for g in _walk(f.body, tirx.For))
    return bool(loops) and not nested and sum(map(_stores, loops)) == _stores(stmt)


def _on_device(block: s_tir.SBlock, threads: int) -> s_tir.SBlock:
    if not _parallel_loops_do_all_work(block.body):
        return _on_one_thread(block)
    body = tvm_ffi.structural_map(
        block.body,
        [(tirx.For, lambda f: _grid(f, threads) if f.kind == tirx.ForKind.PARALLEL else f)],
    )
    return _with_body(block, body)


class OpaqueKernels(dlight.ScheduleRule):
    """Device kernels for functions that launch no threads (see the module docstring)."""

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target,
              tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or _launches_threads(func):
            return None
        calls = _host_calls(func)
        if calls:
            raise UnsupportedOnDeviceError(
                f"unsupported on {target.kind.name}: a kernel calls the host (CPU) function "
                f"{', '.join(calls)}, which cannot read device memory"
            )
        if not _stores(func.body):
            return None
        blocks = _walk(func.body, s_tir.SBlock)
        if len(blocks) != 1 or blocks[0].iter_vars:
            raise UnsupportedOnDeviceError(
                f"unsupported on {target.kind.name}: no schedule rule maps a kernel to device "
                "threads, and as host code it would read device memory"
            )
        threads = max_threads_per_block(target)
        return s_tir.Schedule(tvm_ffi.structural_map(
            func, [(s_tir.SBlock, lambda block: _on_device(block, threads))]
        ))
