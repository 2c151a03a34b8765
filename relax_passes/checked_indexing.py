"""Bounds-checked indexing: ops that index with run-time tensors raise, or stay inside the
tensor, instead of reading or writing out of bounds.

ONNX Gather, GatherElements, GatherND, ScatterElements and ScatterND index a tensor with
values known only at run time. TVM lowers them without bounds checks (`take` in "fast"
mode, TOPI's gathers and scatters): an index past the axis, such as a token id past the
vocabulary, reads or writes outside the buffer, giving wrong values or a segmentation fault
where onnxruntime raises INVALID_ARGUMENT.

1. Put the pass just before LegalizeOps: it legalizes these ops itself, so it must see them
   as Relax ops, after graph fusion, kernel selection and library dispatch took theirs.
2. Each op whose indices are not a constant becomes a call_tir to a kernel that checks every
   index against its axis with a TIR assert in the block that reads it: a compare and a
   branch to an early return with an `IndexError`, which the VM raises in Python; the
   message (`runtime.index_checks.check_message`) names the ONNX op and the model input the
   indices came from, and the run turns it into `InputError` with the offending value. The
   gathers are marked injective (TVM calls its own unchecked ones opaque), so FuseOps fuses
   them with their neighbours and the check runs inside the fused kernel; but only those
   whose output dims are constants or dims of the function's parameters. A dim bound inside
   the function (a shape computed at run time) may be computed by the very ops FuseOps would
   fuse with the gather, which it does not see as a dependence (the dim's binding is lost),
   and an axis of `end - begin` is one FuseTIR cannot take: those stay opaque, as TVM's own.
   So do the clamped kernels of device targets (DLight's GPU reduction rule cannot take a
   gather fused into a reduction). The scatters (opaque kernels) check their indices in a first block of
   their own kernel.
3. Negative indices: the importer wraps them (idx + extent) before Gather, GatherElements,
   GatherND and ScatterND, so those kernels accept [0, extent); ScatterElements' kernel wraps
   them itself and accepts [-extent, extent). Either way ONNX's valid range.
4. A device kernel cannot raise: for a call that runs on a target without the "cpu" key
   (placement's virtual device, else the current target) each index is clamped into its
   axis instead: a wrong value for a bad index, but no access outside the buffer.
5. It does not handle: indices that are constants (folded or checked at import), `take` in
   modes other than "fast" (clip and wrap are safe already), `take` without an axis, and
   ops outside `_OPS` (OneHot compares rather than indexes; TopK's k, Slice, Pad, Resize,
   Reshape, Expand and Tile with run-time parameters: see the README's "Errors and limits").
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import numpy as np
import tvm
from tvm import relax, s_tir, te, tirx, topi
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..runtime.index_checks import check_message

# The attribute marking `require`'s kernels, which the pass strips of their assert on devices.
VALUE_CHECK_ATTR = "gimlet.value_check"
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_INJECTIVE = 2  # TVM's OpPatternKind kInjective: FuseOps fuses it with elementwise neighbours
_OPAQUE = 8  # kOpaque: FuseOps leaves it alone
# Ops that pass index values through unchanged (only their positions may move).
_SAME_VALUES = ("relax.astype",)
_SAME_VALUES_MOVED = ("relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.flatten",
                      "relax.permute_dims")


@dataclasses.dataclass
class _Checks:
    """How one kernel treats the indices it reads.

    `raises`: assert (CPU kernels) rather than clamp (device kernels). `wraps`: the kernel
    maps a negative index to index + extent itself (else the importer did). `index` is the
    index expression the compute uses, `condition` what the assert requires of a read."""

    raises: bool
    wraps: bool
    dtype: str  # the indices' element type

    def index(self, value: tirx.Expr, extent: tirx.Expr) -> tirx.Expr:
        """`value` wrapped if the kernel wraps, clamped into [0, extent) if it cannot raise."""
        extent = extent.astype(self.dtype)
        if self.wraps and not self.dtype.startswith("uint"):
            value = tirx.Select(value < tirx.const(0, self.dtype), value + extent, value)
        if self.raises:
            return value
        return tirx.max(tirx.min(value, extent - tirx.const(1, self.dtype)), tirx.const(0, self.dtype))

    def condition(self, value: tirx.Expr, extent: tirx.Expr) -> tirx.Expr:
        """`value` (as read, before any wrap) lies in the range the kernel accepts."""
        extent = extent.astype(self.dtype)
        upper = value < extent
        if self.dtype.startswith("uint"):
            return upper
        lower = value >= (-extent if self.wraps else tirx.const(0, self.dtype))
        return tirx.And(lower, upper)


# Where one block iteration reads indices: (their positions, the extent each must fit).
Sites = Callable[[Sequence[tirx.Var]], list[tuple[list[tirx.Expr], tirx.Expr]]]


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """How to write one op's kernel: `compute(*tensors)` (TE, given the call's arguments as
    placeholders), the name of the block that reads the indices, and, given the data and
    indices placeholders, the block's check sites and the indexed axes' extents (one, or
    one per coordinate slot)."""

    compute: Callable[..., te.Tensor]
    block: str
    sites: Callable[[te.Tensor, te.Tensor], Sites]
    extents: Callable[[te.Tensor, te.Tensor], list[tirx.Expr]]


@dataclasses.dataclass(frozen=True)
class _Op:
    """One checked op: its ONNX name, how extents apply to the indices (`"element"`: one for
    all, `"axis"`: one per position of the last axis), whether its kernel wraps negative
    indices, whether its kernel is injective (a gather) and `kernel(checks, call)`."""

    onnx: str
    per: str
    wraps: bool
    injective: bool
    kernel: Callable[[_Checks, relax.Call], _Kernel]


def _take(checks: _Checks, call: relax.Call):
    axis = int(call.attrs.axis)

    def compute(data: te.Tensor, indices: te.Tensor) -> te.Tensor:
        rank = len(indices.shape)
        axis_ = axis % len(data.shape)
        shape = [*data.shape[:axis_], *indices.shape, *data.shape[axis_ + 1:]]

        def element(*i):
            index = checks.index(indices(*i[axis_:axis_ + rank]), data.shape[axis_])
            return data(*i[:axis_], index, *i[axis_ + rank:])
        return te.compute(shape, element, name="checked_take", tag="injective")

    def sites(data: te.Tensor, indices: te.Tensor) -> Sites:
        axis_, rank = axis % len(data.shape), len(indices.shape)
        return lambda iv: [(list(iv[axis_:axis_ + rank]), data.shape[axis_])]
    return _Kernel(compute, "checked_take", sites, lambda data, _: [data.shape[axis % len(data.shape)]])


def _gather_elements(checks: _Checks, call: relax.Call):
    axis = int(call.attrs.axis)

    def compute(data: te.Tensor, indices: te.Tensor) -> te.Tensor:
        axis_ = axis % len(data.shape)

        def element(*i):
            index = checks.index(indices(*i), data.shape[axis_])
            return data(*i[:axis_], index, *i[axis_ + 1:])
        return te.compute(indices.shape, element, name="checked_gather_elements", tag="injective")

    def sites(data: te.Tensor, indices: te.Tensor) -> Sites:
        return lambda iv: [(list(iv), data.shape[axis % len(data.shape)])]
    return _Kernel(compute, "checked_gather_elements", sites,
                   lambda data, _: [data.shape[axis % len(data.shape)]])


def _gather_nd(checks: _Checks, call: relax.Call):
    batch = int(call.attrs.batch_dims)

    def compute(data: te.Tensor, indices: te.Tensor) -> te.Tensor:
        outer, slots = len(indices.shape) - 1, int(indices.shape[-1])
        shape = [*indices.shape[:-1], *data.shape[batch + slots:]]

        def element(*i):
            coords = [checks.index(indices(*i[:outer], j), data.shape[batch + j]) for j in range(slots)]
            return data(*i[:batch], *coords, *i[outer:])
        return te.compute(shape, element, name="checked_gather_nd", tag="injective")

    def sites(data: te.Tensor, indices: te.Tensor) -> Sites:
        outer, slots = len(indices.shape) - 1, int(indices.shape[-1])
        return lambda iv: [([*iv[:outer], tirx.const(j, "int64")], data.shape[batch + j]) for j in range(slots)]
    return _Kernel(compute, "checked_gather_nd", sites, lambda data, indices: list(
        data.shape[batch:batch + int(indices.shape[-1])]))


def _checked_indices(checks: _Checks, indices: te.Tensor, extent_of: Callable[[tirx.Expr], tirx.Expr]) -> te.Tensor:
    """The indices, each checked (or clamped) against `extent_of(its position's last index)`:
    the first block of a scatter kernel."""
    return te.compute(indices.shape, lambda *i: checks.index(indices(*i), extent_of(i[-1])),
                      name="checked_indices")


def _scatter_elements(checks: _Checks, call: relax.Call):
    axis, reduction = int(call.attrs.axis), call.attrs.reduction
    scatter = topi.scatter_elements if checks.raises else topi.gpu.scatter_elements

    def compute(data: te.Tensor, indices: te.Tensor, updates: te.Tensor) -> te.Tensor:
        extent = data.shape[axis % len(data.shape)]
        return scatter(data, _checked_indices(checks, indices, lambda _: extent), updates, axis, reduction)

    def sites(data: te.Tensor, indices: te.Tensor) -> Sites:
        return lambda iv: [(list(iv), data.shape[axis % len(data.shape)])]
    return _Kernel(compute, "checked_indices", sites,
                   lambda data, _: [data.shape[axis % len(data.shape)]])


def _slot_extent(data: te.Tensor, slots: int) -> Callable[[tirx.Expr], tirx.Expr]:
    """data's extent along the axis a coordinate slot indexes (ScatterND: slot j, axis j)."""
    def extent(slot: tirx.Expr) -> tirx.Expr:
        chosen = data.shape[slots - 1]
        for j in reversed(range(slots - 1)):
            chosen = tirx.Select(slot == j, data.shape[j], chosen)
        return chosen
    return extent


def _scatter_nd(checks: _Checks, call: relax.Call):
    reduction = call.attrs.reduction
    scatter = topi.scatter_nd if checks.raises else topi.gpu.scatter_nd

    def compute(data: te.Tensor, indices: te.Tensor, updates: te.Tensor) -> te.Tensor:
        checked = _checked_indices(checks, indices, _slot_extent(data, int(indices.shape[-1])))
        axes = list(range(len(indices.shape)))
        return scatter(data, topi.transpose(checked, axes[-1:] + axes[:-1]), updates, reduction)

    def sites(data: te.Tensor, indices: te.Tensor) -> Sites:
        return lambda iv: [(list(iv), _slot_extent(data, int(indices.shape[-1]))(iv[-1]))]
    return _Kernel(compute, "checked_indices", sites,
                   lambda data, indices: list(data.shape[:int(indices.shape[-1])]))


_OPS = {
    "relax.take": _Op("Gather", "element", False, True, _take),
    "relax.gather_elements": _Op("GatherElements", "element", False, True, _gather_elements),
    "relax.gather_nd": _Op("GatherND", "axis", False, True, _gather_nd),
    "relax.scatter_elements": _Op("ScatterElements", "element", True, False, _scatter_elements),
    "relax.scatter_nd": _Op("ScatterND", "axis", False, False, _scatter_nd),
}


@tvm.transform.module_pass(opt_level=0, name="CheckedIndexing")
class CheckedIndexing:  # pylint: disable=too-few-public-methods
    """Legalize gathers and scatters with run-time indices into bounds-checked kernels."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """IRModule-level transformation."""
        rewriter = _Rewriter(mod)
        for g_var, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.inputs = {param.name for param in func.params}
                rewriter.entry_dims = {dim for param in func.params for dim in _dims(param.ty)
                                       if isinstance(dim, tirx.Var)}
                rewriter.builder_.update_func(g_var, rewriter.visit_expr(func))
        return rewriter.builder_.get()


def _raises(call: relax.Call) -> bool:
    """Whether the kernel for `call` can raise: it runs on a CPU."""
    vdevice = getattr(call.ty, "vdevice", None)
    target = vdevice.target if vdevice is not None else tvm.target.Target.current()
    return target is None or "cpu" in target.keys


def _dims(ty: relax.Type) -> list[tirx.Expr]:
    """The dims of a tensor type with a known shape, else none."""
    shape = getattr(ty, "shape", None)
    return list(shape.values) if isinstance(shape, relax.ShapeExpr) else []


def _indices_arg(call: relax.Call) -> relax.Expr:
    return call.args[1]


@mutator
class _Rewriter(PyExprMutator):  # pylint: disable=abstract-method
    inputs: set[str] = set()
    entry_dims: set[tirx.Var] = set()

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if call.op.same_as(_CALL_TIR) and not _raises(call):
            return self._without_value_check(call)
        op = _OPS.get(call.op.name) if isinstance(call.op, tvm.ir.Op) else None
        if op is None or isinstance(_indices_arg(call), tvm.ir.GenericConst) or not _checkable(call):
            return call
        checks = _Checks(_raises(call), op.wraps, str(_indices_arg(call).ty.dtype))
        kernel = op.kernel(checks, call)
        tensors: list[te.Tensor] = []

        def recording(*placeholders: te.Tensor) -> te.Tensor:
            tensors.extend(placeholders[:2])
            return kernel.compute(*placeholders)
        lowered = self.builder_.call_te(recording, *call.args, primfunc_name_hint=f"checked_{op.onnx.lower()}")
        g_var = lowered.args[0]
        func = self.builder_.get()[g_var]
        if checks.raises:
            data, indices = tensors
            extents = [int(e) if isinstance(e, tirx.IntImm) else None for e in kernel.extents(data, indices)]
            message = check_message(op.onnx, self._source(_indices_arg(call), op.per), extents, op.per)
            func = _with_asserts(func, kernel.block, indices.name, kernel.sites(data, indices), checks, message)
        if op.injective:
            known = all(isinstance(dim, tirx.IntImm) or dim in self.entry_dims for dim in _dims(call.ty))
            func = func.with_attr("op_pattern", _INJECTIVE if known and checks.raises else _OPAQUE)
        self.builder_.update_func(g_var, func)
        # The call's own type: the kernel's output keeps the call's virtual device, if any.
        return relax.call_tir(g_var, lowered.args[1], call.ty)

    def _without_value_check(self, call: relax.Call) -> relax.Call:
        """A `require` kernel's call on a device target, which cannot raise, goes to a copy of
        the kernel without its assert (the value passes unchecked); other calls stay."""
        func = self.builder_.get()[call.args[0]]
        if not isinstance(func, tirx.PrimFunc) or VALUE_CHECK_ATTR not in (func.attrs or {}):
            return call

        def strip(block: s_tir.SBlock) -> s_tir.SBlock:
            return s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, block.body.seq[1],
                                block.init, block.alloc_buffers, block.match_buffers)
        unchecked = func.with_body(_map_block(func.body, "checked_values", strip)).without_attr(VALUE_CHECK_ATTR)
        g_var = self.builder_.add_func(unchecked, "unchecked_values")
        return relax.Call(call.op, [g_var, *call.args[1:]], call.attrs, call.ty_args)

    def _source(self, expr: relax.Expr, per: str) -> str | None:
        """The model input `expr`'s values come from unchanged (through casts, the importer's
        negative-index wrap, and for one extent per element through reshapes), if any."""
        passing = _SAME_VALUES + (_SAME_VALUES_MOVED if per == "element" else ())
        while isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            if bound is None:
                return expr.name if expr.name in self.inputs else None
            expr = _passed_through(bound, passing)
        return None


def _passed_through(expr: relax.Expr, passing: tuple[str, ...]) -> relax.Expr | None:
    """The operand whose values `expr` passes on: an op of `passing`, or the importer's
    `where(x < 0, x + extent, x)`."""
    if not isinstance(expr, relax.Call) or not isinstance(expr.op, tvm.ir.Op):
        return None
    if expr.op.name in passing:
        return expr.args[0]
    if expr.op.name == "relax.where":
        return expr.args[2]
    return None


def _checkable(call: relax.Call) -> bool:
    """Whether the pass can write `call`'s kernel: known ranks, a static GatherND/ScatterND
    coordinate count, `take` in "fast" mode with an axis."""
    if any(not isinstance(arg.ty, relax.TensorType) or arg.ty.ndim < 0 for arg in call.args):
        return False
    if call.op.name == "relax.take":
        return call.attrs.axis is not None and call.attrs.mode == "fast"
    if call.op.name in ("relax.gather_nd", "relax.scatter_nd"):
        shape = call.args[1].ty.shape
        return shape is not None and isinstance(shape[-1], tirx.IntImm)
    return True


def _with_asserts(func: tirx.PrimFunc, block: str, indices: str, sites: Sites, checks: _Checks,
                  message: str) -> tirx.PrimFunc:
    """`func` with an assert opening the body of its block `block`: every index the block
    reads from buffer `indices` (at `sites` of its iteration variables) lies in its axis."""
    def check(found: s_tir.SBlock) -> s_tir.SBlock:
        buffer = next(region.source for region in found.reads if region.source.name == indices)
        conditions = [checks.condition(tirx.BufferLoad(buffer, positions), extent)
                      for positions, extent in sites([iv.var for iv in found.iter_vars])]
        return _asserting(found, functools.reduce(tirx.And, conditions), message)
    return func.with_body(_map_block(func.body, block, check))


def _asserting(block: s_tir.SBlock, condition: tirx.Expr, message: str,
               reads: Sequence[tirx.BufferRegion] = ()) -> s_tir.SBlock:
    """`block` opening with an assert of `condition` (raising `IndexError: message`), reading
    `reads` too. A schedule vectorizes only loops the condition does not depend on (LLVM
    cannot branch on a vector of conditions: `schedules/rules/cpu/base.vectorizable_axes`)."""
    # TVM 0.27's Python AssertStmt passes its arguments in the wrong order to the FFI
    # constructor, which takes (condition, kind, message parts).
    assertion = tirx.AssertStmt(condition, tvm.ir.StringImm("IndexError"), [tvm.ir.StringImm(message)])
    return s_tir.SBlock(block.iter_vars, [*block.reads, *reads], block.writes, block.name_hint,
                        tirx.SeqStmt([assertion, block.body]), block.init, block.alloc_buffers,
                        block.match_buffers, block.annotations)


def require(bb: relax.BlockBuilder, value: relax.Expr, ok: relax.Expr, message: str) -> relax.Expr:
    """`value` passed on by a kernel that first asserts every element of the bool tensor `ok`
    (of static shape): how converters check what only the run knows (a size, a step) before
    anything computes with it. Whatever uses the check's result runs after it; `message` is
    `runtime.index_checks.value_check_message`'s, which a run turns into `InputError`."""
    flags_shape = [int(dim) for dim in ok.ty.shape]

    def compute(values: te.Tensor, _flags: te.Tensor) -> te.Tensor:
        return te.compute(values.shape, lambda *i: values(*i), name="checked_values")
    call = bb.call_te(compute, value, ok, primfunc_name_hint="checked_values")
    g_var = call.args[0]
    func = bb.get()[g_var]
    flags = func.params[1]  # a buffer-typed parameter: loads and regions take it as the buffer
    condition = functools.reduce(tirx.And, [tirx.BufferLoad(flags, [tirx.const(i, "int64") for i in at])
                                            for at in np.ndindex(*flags_shape)], tirx.const(True, "bool"))
    region = tirx.BufferRegion(flags, [tvm.ir.Range.from_min_extent(0, dim) for dim in flags_shape])

    def check(found: s_tir.SBlock) -> s_tir.SBlock:
        return _asserting(found, condition, message, [region])
    checked = func.with_body(_map_block(func.body, "checked_values", check))
    bb.update_func(g_var, checked.with_attr(VALUE_CHECK_ATTR, True))
    return bb.emit(call)


def _map_block(stmt: tirx.Stmt, name: str, rewrite: Callable[[s_tir.SBlock], s_tir.SBlock]) -> tirx.Stmt:
    """`stmt` with its block `name` replaced by `rewrite(block)`: TE's loop nests of blocks,
    rebuilt node by node (TVM offers no statement mutator to Python)."""
    if isinstance(stmt, s_tir.SBlockRealize):
        return s_tir.SBlockRealize(stmt.iter_values, stmt.predicate, _map_block(stmt.block, name, rewrite))
    if isinstance(stmt, s_tir.SBlock):
        if stmt.name_hint == name:
            return rewrite(stmt)
        return s_tir.SBlock(stmt.iter_vars, stmt.reads, stmt.writes, stmt.name_hint,
                            _map_block(stmt.body, name, rewrite), stmt.init,
                            stmt.alloc_buffers, stmt.match_buffers, stmt.annotations)
    if isinstance(stmt, tirx.For):
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, _map_block(stmt.body, name, rewrite),
                        stmt.thread_binding, stmt.annotations)
    if isinstance(stmt, tirx.SeqStmt):
        return tirx.SeqStmt([_map_block(part, name, rewrite) for part in stmt.seq])
    return stmt
