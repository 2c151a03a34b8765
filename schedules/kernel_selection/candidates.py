"""What kernel selection chooses between: `Candidate` implementations of one `OpSignature`.

An op signature is a Relax op at static shapes and one dtype (for now `matmul` of an
operand of rank >= 2 by a rank-2 operand: every linear layer of the suite) together with the
elementwise epilogue the target's library call absorbs (bias and residual adds, ReLU, GELU:
on the CPU exactly what `DispatchCPULibrary` fuses into `gimlet.cpu.matmul`, read back from
its calls). A candidate rewrites that whole group into its implementation before
legalization: generated TIR (`call_tir` of the legalized op, the epilogue left as Relax ops
for FuseOps to fuse, scheduled later by MetaSchedule records or the target's default rules),
a library call (left as the library pass wrote it), a hand-written or an external PrimFunc
(`call_tir`, batch axes folded into rows, the epilogue's addends passed after the operands).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import numpy as np
import tvm
from tvm import relax

from ...relax_passes.dispatch_cpu_library import library_matmul

SOURCES = ("generated", "library", "handwritten", "external")

Rewrite = Callable[[relax.BlockBuilder, relax.Call], relax.Expr]
"""Emits the candidate's implementation of `call` (an op group of the candidate's signature)."""

# Dims of the edge-case shape (rows, reduction, columns): no multiple of any tile size.
EDGE_DIMS = (11, 37, 69)
ACTIVATIONS = {"relu": relax.op.nn.relu, "gelu": relax.op.nn.gelu}

Step = tuple[str, tuple[int, ...]]
"""An epilogue step: `("add", addend shape)`, `("relu", ())` or `("gelu", ())`."""


def _static_shape(expr: relax.Expr) -> tuple[int, ...] | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None or not hasattr(ty.shape, "values"):
        return None
    if not all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape.values):
        return None
    return tuple(int(d) for d in ty.shape.values)


def group_operands(call: relax.Expr) -> tuple[relax.Expr, relax.Expr, list[relax.Expr], list[Step]] | None:
    """`(a, b, addends, epilogue)` of a plain `R.matmul(a, b)` (no epilogue) or of a CPU
    library matmul call with its absorbed epilogue; None for anything else (also a library
    call with a transposed `b` or a vector added along another than the last axis)."""
    if isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.matmul":
        return call.args[0], call.args[1], [], []
    parts = library_matmul(call)
    if parts is None or parts[2]:
        return None
    a, b, _, steps = parts
    addends, epilogue = [], []
    for step in steps:
        if step[0] == "add":
            shape = _static_shape(step[1])
            if shape is None or step[2] != 1:
                return None
            addends.append(step[1])
            epilogue.append(("add", shape))
        else:
            epilogue.append((step[0], ()))
    return a, b, addends, epilogue


@dataclasses.dataclass(frozen=True)
class OpSignature:
    """An op group at static shapes: `shapes` of the op's tensor operands, all of `dtype`,
    then its `epilogue` steps in order; `weight`: the second operand is a constant (a model
    weight), so a kernel may take it in its own layout, converted at build time."""

    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    epilogue: tuple[Step, ...] = ()
    weight: bool = False

    @classmethod
    def of_call(cls, call: relax.Expr) -> OpSignature | None:
        """The signature of `call`, or None when selection does not handle it."""
        parts = group_operands(call)
        if parts is None:
            return None
        a_var, b_var, addends, epilogue = parts
        shapes, dtypes = [], set()
        for arg in (a_var, b_var, *addends):
            shape = _static_shape(arg)
            if shape is None:
                return None
            shapes.append(shape)
            dtypes.add(str(arg.ty.dtype))
        a, b = shapes[:2]
        if len(a) < 2 or len(b) != 2 or len(dtypes) != 1 or a[-1] != b[0]:
            return None
        return cls("matmul", (a, b), dtypes.pop(), tuple(epilogue), isinstance(b_var, tvm.ir.expr.Constant))

    @property
    def key(self) -> str:
        """`matmul float32 1x1024 @ const 1024x4096 +4096 relu`: stable, readable, the records'
        key (`const`: a weight)."""
        steps = [f"+{'x'.join(map(str, shape))}" if kind == "add" else kind for kind, shape in self.epilogue]
        a, b = ("x".join(map(str, s)) for s in self.shapes)
        return " ".join([f"{self.op} {self.dtype}", a, "@", *(["const"] if self.weight else []), b, *steps])

    @property
    def out_shape(self) -> tuple[int, ...]:
        a, b = self.shapes
        return (*a[:-1], b[1])

    @property
    def gemm(self) -> tuple[int, int, int]:
        """(M, N, K) with batch axes folded into M."""
        a, b = self.shapes
        return math.prod(a[:-1]), b[1], b[0]

    @property
    def addend_shapes(self) -> list[tuple[int, ...]]:
        return [shape for kind, shape in self.epilogue if kind == "add"]

    def addends_2d(self) -> list[tuple[int, int]] | None:
        """Each addend as the (rows, columns) it broadcasts over in the (M, N) output: rows 1
        or M, columns 1 or N; None when one broadcasts otherwise."""
        m, n, _ = self.gemm
        out = self.out_shape
        found = []
        for shape in self.addend_shapes:
            aligned = (1,) * (len(out) - len(shape)) + shape
            rows, cols = aligned[:-1], aligned[-1]
            if all(d == 1 for d in rows):
                found.append((1, cols))
            elif rows == out[:-1]:
                found.append((m, cols))
            else:
                return None
        return found

    def edge_case(self) -> OpSignature:
        """The same op group at small shapes that are no multiple of any tile (tails everywhere)."""
        m, k, n = EDGE_DIMS
        a = (*[1] * (len(self.shapes[0]) - 2), m, k)
        out, edge_out = self.out_shape, (*a[:-1], n)

        def edge(shape: tuple[int, ...]) -> tuple[int, ...]:
            offset = len(out) - len(shape)
            return tuple(1 if d == 1 else edge_out[offset + i] for i, d in enumerate(shape))

        epilogue = tuple((kind, edge(shape)) for kind, shape in self.epilogue)
        return OpSignature(self.op, (a, (k, n)), self.dtype, epilogue, self.weight)

    def call(self) -> relax.Call:
        """The op applied to fresh variables of its operand types (no epilogue)."""
        args = [relax.Var(f"arg{i}", relax.TensorType(shape, self.dtype)) for i, shape in enumerate(self.shapes)]
        return relax.op.matmul(*args)

    def module(self, weights: Sequence[np.ndarray] = ()) -> tvm.IRModule:
        """`main(operands..., addends...)` computing the op group as plain Relax ops. With
        `weights`, B is no parameter: `main(a, addends...)` runs the group once with each of
        them as a constant (as a model's weights reach its kernels) and returns a tuple."""
        call = self.call()
        a, b = call.args
        addends = [relax.Var(f"addend{i}", relax.TensorType(shape, self.dtype))
                   for i, shape in enumerate(self.addend_shapes)]
        bs = [relax.const(w.astype(self.dtype)) for w in weights] or [b]
        bb = relax.BlockBuilder()
        with bb.function("main", [a, *([] if weights else [b]), *addends]):
            with bb.dataflow():
                outs = [bb.emit(emit_epilogue(bb, bb.emit(relax.op.matmul(a, w)), addends, self.epilogue))
                        for w in bs]
                out = bb.emit_output(relax.Tuple(outs) if weights else outs[0])
            bb.emit_func_output(out)
        return bb.finalize()

    def reference(self, *operands: np.ndarray) -> np.ndarray:
        """What the op group computes, in float64 numpy."""
        a, b, *addends = (x.astype(np.float64) for x in operands)
        out, addends = a @ b, iter(addends)
        for kind, _ in self.epilogue:
            if kind == "add":
                out = out + next(addends)
            elif kind == "relu":
                out = np.maximum(out, 0)
            else:
                out = 0.5 * out * (1 + _erf(out / math.sqrt(2)))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "shapes": [list(s) for s in self.shapes], "dtype": self.dtype,
                "epilogue": [[kind, list(shape)] for kind, shape in self.epilogue], "weight": self.weight}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpSignature:
        epilogue = tuple((kind, tuple(shape)) for kind, shape in data.get("epilogue", []))
        return cls(data["op"], tuple(tuple(s) for s in data["shapes"]), data["dtype"], epilogue,
                   data.get("weight", False))


_erf = np.vectorize(math.erf, otypes=[np.float64])


def emit_epilogue(bb: relax.BlockBuilder, out: relax.Expr, addends: list[relax.Expr],
                  epilogue: tuple[Step, ...] | list[Step]) -> relax.Expr:
    """`out` with the epilogue's steps applied as Relax ops (the last one not emitted)."""
    addends = iter(addends)
    for index, (kind, _) in enumerate(epilogue):
        out = bb.emit(out) if index else out
        out = relax.op.add(out, next(addends)) if kind == "add" else ACTIVATIONS[kind](out)
    return out


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One implementation of an op signature on a target.

    source: one of SOURCES; name: unique within the source; provenance: where the code comes
    from (a file, a library function, a records directory); rewrite: emits it;
    shape_generic: it is made for any shape of the op, so verification also runs it at the
    edge-case shape; digest: a hash of its code where it lives outside the compiler (external);
    unavailable: why it cannot be built on this machine at all (then it is listed, never tried).
    """

    source: str
    name: str
    provenance: str
    rewrite: Rewrite
    shape_generic: bool = True
    digest: str = ""
    unavailable: str | None = None

    @property
    def id(self) -> str:
        return f"{self.source}:{self.name}"


def pack_panels(bb: relax.BlockBuilder, b: relax.Expr, packed: tuple[int, int, int]) -> relax.Expr:
    """B[K, N] as `packed` = [panels, K, width]: zero-padded along N to panels x width, each
    panel's columns one contiguous run (folded into a constant at build time when B is one)."""
    panels, k, width = packed
    n = int(b.ty.shape[1])
    if panels * width > n:
        b = bb.emit(relax.op.nn.pad(b, [0, 0, 0, panels * width - n]))
    return bb.emit(relax.op.permute_dims(relax.op.reshape(b, (k, panels, width)), [1, 0, 2]))


def call_prim_func(bb: relax.BlockBuilder, call: relax.Call, func: tvm.tirx.PrimFunc,
                   name: str, packed_b: tuple[int, int, int] | None = None) -> relax.Expr:
    """`call` (a matmul group) as `call_tir` of a 2-D GEMM PrimFunc `(a[M, K], b, addends...,
    c[M, N])`, b being B[K, N] or, with `packed_b`, `pack_panels(B)`; batch axes of the first
    operand folded into M and unfolded after; each addend reshaped to the (rows, columns) of
    `OpSignature.addends_2d`."""
    a, b, addends, _ = group_operands(call)
    sig = OpSignature.of_call(call)
    m, n, k = sig.gemm
    # Opaque: FuseOps must not fuse into a scheduled kernel; no symbol of its own, so that
    # several shapes of one kernel in a model each get theirs from their GlobalVar.
    func = func.with_attr("op_pattern", 8).without_attr("global_symbol")
    gvar = bb.add_func(func, name)
    b = b if packed_b is None else pack_panels(bb, b, packed_b)
    a2 = a if len(sig.shapes[0]) == 2 else bb.emit(relax.op.reshape(a, (m, k)))
    flat = [bb.emit(relax.op.reshape(x, shape)) for x, shape in zip(addends, sig.addends_2d())]
    out = bb.emit(relax.call_tir(gvar, [a2, b, *flat], relax.TensorType((m, n), sig.dtype)))
    return out if len(sig.shapes[0]) == 2 else relax.op.reshape(out, call.ty.shape)
