"""Fold Relax ops on constants with numpy, where TVM's FoldConstant compiles a kernel for each.

1. Where it goes: right before each `relax.transform.FoldConstant` that would meet such ops
   (`compiler.canonicalize_passes`: batch norms folded into conv weights; `compiler.
   kernel_passes`, after the library passes: weights packed for library kernels, before
   `LegalizeOps` turns those ops into `call_tir`s only FoldConstant can evaluate).
2. FoldConstant evaluates each foldable op by building a TIR function for it with LLVM, about
   12 ms each and more around it: the suite's resnet18_like (batch norms) had 174 of them and
   built in 6.4 s, 1.2 s with them folded here (benchmarks/README.md, "Depthwise convs in row
   bands, constants folded with numpy"). Here an op whose tensor operands are all constants
   (bound ones included) and whose kind is in `HOST_FOLDS` becomes the constant numpy
   computes. The ops kept are those numpy computes bit for bit as the compiled kernel does:
   IEEE-rounded float arithmetic (+, -, *, /, sqrt, min, max, negation) and data movement
   (reshape, transposes, layout transforms with padding).
3. It does not handle: ops with inexact results (exp, rsqrt, ...), integer division,
   symbolic shapes, anything else; those stay for FoldConstant.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tvm
from tvm import IRModule, relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .chain_matching import rewrite_functions


class _NotFoldable(Exception):
    """An op this pass leaves to FoldConstant."""


def _static_shape(expr: relax.Expr) -> tuple[int, ...]:
    shape = expr.ty.shape
    if shape is None or not all(isinstance(d, tirx.IntImm) for d in shape):
        raise _NotFoldable
    return tuple(int(d) for d in shape)


_FLOATS = ("float16", "float32", "float64")
_INDEX_OPS: dict[type, Callable] = {
    tirx.Add: np.add, tirx.Sub: np.subtract, tirx.Mul: np.multiply,
    tirx.FloorDiv: np.floor_divide, tirx.FloorMod: np.mod, tirx.Min: np.minimum, tirx.Max: np.maximum,
}


def _index(expr: tirx.PrimExpr, variables: list[tuple[tirx.Var, np.ndarray]]) -> np.ndarray | int:
    """An index map's output index over numpy index grids for its input variables."""
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tirx.Var):
        return next(grid for var, grid in variables if var.same_as(expr))
    fn = _INDEX_OPS.get(type(expr))
    if fn is None:
        raise _NotFoldable
    return fn(_index(expr.a, variables), _index(expr.b, variables))


_INDEX_CHUNK = 1 << 20  # input elements whose output indices are computed at once


def _layout_transform(call: relax.Call, x: np.ndarray) -> np.ndarray:
    """x moved by the op's index map into its (static) output shape, pad_value elsewhere; a
    chunk of x's leading axis at a time (the indices take 8 bytes an element and axis)."""
    if x.ndim == 0 or x.size == 0:
        raise _NotFoldable
    index_map = call.attrs.index_map
    pad = call.attrs.pad_value
    out = np.full(_static_shape(call), 0 if pad is None else pad.value, x.dtype)
    rows = max(1, _INDEX_CHUNK * x.shape[0] // x.size)
    for start in range(0, x.shape[0], rows):
        chunk = x[start:start + rows]
        grids = list(np.indices(chunk.shape, sparse=True))
        grids[0] = grids[0] + start
        variables = list(zip(index_map.initial_indices, grids))
        out[tuple(np.broadcast_to(_index(e, variables), chunk.shape) for e in index_map.final_indices)] = chunk
    return out


def _float_op(fn: Callable[..., np.ndarray]) -> Callable[[relax.Call, list], np.ndarray]:
    """An elementwise op, for floats only (integer division and overflow differ from numpy)."""
    def fold(call: relax.Call, operands: list[np.ndarray]) -> np.ndarray:
        if str(call.ty.dtype) not in _FLOATS or any(str(a.dtype) not in _FLOATS for a in operands):
            raise _NotFoldable
        return fn(*operands)
    return fold


def _axes(call: relax.Call) -> list[int] | None:
    return None if call.attrs.axes is None else [int(a) for a in call.attrs.axes]


HOST_FOLDS: dict[str, Callable[[relax.Call, list[np.ndarray]], np.ndarray]] = {
    "relax.add": _float_op(np.add),
    "relax.subtract": _float_op(np.subtract),
    "relax.multiply": _float_op(np.multiply),
    "relax.divide": _float_op(np.divide),
    "relax.maximum": _float_op(np.maximum),
    "relax.minimum": _float_op(np.minimum),
    "relax.negative": _float_op(np.negative),
    "relax.sqrt": _float_op(np.sqrt),
    "relax.reshape": lambda call, ops: ops[0].reshape(_static_shape(call)),
    "relax.permute_dims": lambda call, ops: np.transpose(ops[0], _axes(call)),
    "relax.expand_dims": lambda call, ops: ops[0].reshape(_static_shape(call)),
    "relax.squeeze": lambda call, ops: ops[0].reshape(_static_shape(call)),
    "relax.layout_transform": lambda call, ops: _layout_transform(call, ops[0]),
}
"""Op name -> its numpy evaluation (the call, its tensor operands as arrays)."""


@tvm.transform.module_pass(opt_level=0, name="FoldConstantsWithNumpy")
class FoldConstantsWithNumpy:  # pylint: disable=too-few-public-methods
    """Replace `HOST_FOLDS` ops on constants by their numpy results."""

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        """IRModule-level transformation."""
        return rewrite_functions(mod, _ConstantFolder)


@mutator
class _ConstantFolder(PyExprMutator):  # pylint: disable=abstract-method
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or call.op.name not in HOST_FOLDS:
            return call
        if not isinstance(call.ty, relax.TensorType) or call.ty.dtype is None:
            return call
        operands = []
        for arg in call.args:
            if isinstance(arg, relax.ShapeExpr):
                continue  # a target shape: the call's type says it
            value = self.lookup_binding(arg) if isinstance(arg, relax.Var) else arg
            if isinstance(value, tvm.ir.GenericConst):
                operands.append(value.value.numpy())
            elif isinstance(value, (tirx.IntImm, tirx.FloatImm)):  # a scalar operand
                operands.append(np.array(value.value, str(value.ty)))
            else:
                return call
        try:
            result = HOST_FOLDS[call.op.name](call, operands)
            expected = (_static_shape(call), str(call.ty.dtype))
        except _NotFoldable:
            return call
        if (result.shape, str(result.dtype)) != expected:
            return call  # numpy's broadcasting or types differ from the op's: not ours to fold
        return relax.const(np.ascontiguousarray(result))
