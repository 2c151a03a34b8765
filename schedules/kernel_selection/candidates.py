"""What kernel selection chooses between: `Candidate` implementations of one `OpSignature`.

An op signature is a Relax op at static shapes and one dtype (for now `matmul` of an
operand of rank >= 2 by a rank-2 operand: every linear layer of the suite). A candidate
rewrites that op's call into its implementation before library dispatch and legalization:
generated TIR (`call_tir` of the legalized op, scheduled later by MetaSchedule records or the
target's default rules), a library call (left to the target's library pass), a hand-written
or an external PrimFunc (`call_tir`, batch axes folded into rows).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np
import tvm
from tvm import relax

SOURCES = ("generated", "library", "handwritten", "external")

Rewrite = Callable[[relax.BlockBuilder, relax.Call], relax.Expr]
"""Emits the candidate's implementation of `call` (an op of the candidate's signature)."""

# Dims of the edge-case shape (rows, reduction, columns): no multiple of any tile size.
EDGE_DIMS = (11, 37, 69)


@dataclasses.dataclass(frozen=True)
class OpSignature:
    """A Relax op at static shapes: `shapes` of its tensor operands, all of `dtype`."""

    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str

    @classmethod
    def of_call(cls, call: relax.Expr) -> OpSignature | None:
        """The signature of `call`, or None when selection does not handle it."""
        if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)
                and call.op.name == "relax.matmul"):
            return None
        shapes, dtypes = [], set()
        for arg in call.args:
            ty = arg.ty
            if not isinstance(ty, relax.TensorType) or ty.shape is None or not hasattr(ty.shape, "values"):
                return None
            if not all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape.values):
                return None
            shapes.append(tuple(int(d) for d in ty.shape.values))
            dtypes.add(str(ty.dtype))
        a, b = shapes
        if len(a) < 2 or len(b) != 2 or len(dtypes) != 1 or a[-1] != b[0]:
            return None
        return cls("matmul", (a, b), dtypes.pop())

    @property
    def key(self) -> str:
        """`matmul float32 1x1024 @ 1024x4096`: stable, readable, the records' key."""
        return f"{self.op} {self.dtype} " + " @ ".join("x".join(map(str, s)) for s in self.shapes)

    @property
    def gemm(self) -> tuple[int, int, int]:
        """(M, N, K) with batch axes folded into M."""
        a, b = self.shapes
        return math.prod(a[:-1]), b[1], b[0]

    @property
    def flops(self) -> int:
        m, n, k = self.gemm
        return 2 * m * n * k

    def edge_case(self) -> OpSignature:
        """The same op at small shapes that are no multiple of any tile (tails everywhere)."""
        m, k, n = EDGE_DIMS
        a = (*[1] * (len(self.shapes[0]) - 2), m, k)
        return OpSignature(self.op, (a, (k, n)), self.dtype)

    def call(self) -> relax.Call:
        """The op applied to fresh variables of its operand types."""
        args = [relax.Var(f"arg{i}", relax.TensorType(shape, self.dtype)) for i, shape in enumerate(self.shapes)]
        return relax.op.matmul(*args)

    def module(self) -> tvm.IRModule:
        """`main(operands...)` computing the op alone."""
        call = self.call()
        bb = relax.BlockBuilder()
        with bb.function("main", list(call.args)):
            with bb.dataflow():
                out = bb.emit_output(call)
            bb.emit_func_output(out)
        return bb.finalize()

    def reference(self, *operands: np.ndarray) -> np.ndarray:
        """What the op computes, in float64 numpy."""
        a, b = (x.astype(np.float64) for x in operands)
        return a @ b

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "shapes": [list(s) for s in self.shapes], "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpSignature:
        return cls(data["op"], tuple(tuple(s) for s in data["shapes"]), data["dtype"])


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


def call_prim_func(bb: relax.BlockBuilder, call: relax.Call, func: tvm.tirx.PrimFunc,
                   name: str) -> relax.Expr:
    """`call` (a matmul) as `call_tir` of a 2-D GEMM PrimFunc `(a[M, K], b[K, N], c[M, N])`,
    batch axes of the first operand folded into M and unfolded after."""
    a, b = call.args
    sig = OpSignature.of_call(call)
    m, n, k = sig.gemm
    func = func.with_attr("op_pattern", 8)  # opaque: FuseOps must not fuse into a scheduled kernel
    gvar = bb.add_func(func, name)
    a2 = a if len(sig.shapes[0]) == 2 else bb.emit(relax.op.reshape(a, (m, k)))
    out = bb.emit(relax.call_tir(gvar, [a2, b], relax.TensorType((m, n), sig.dtype)))
    return out if len(sig.shapes[0]) == 2 else relax.op.reshape(out, call.ty.shape)
