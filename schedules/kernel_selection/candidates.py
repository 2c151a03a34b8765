"""What kernel selection chooses between: `Candidate` implementations of one `OpSignature`.

An op signature is an op of `op_kinds.OP_KINDS` (matmul, attention, conv2d on NCHW or blocked
data, layer and RMS norm, dequant_gemv) at static shapes (a rows-generic op's rows: 1) and its operands' dtypes,
together with the elementwise epilogue the target's library call absorbs (on the CPU exactly
what `DispatchCPULibrary` fuses into its call, read back from it). A candidate rewrites that
whole group into its implementation before legalization: generated TIR (`call_tir` of the
legalized op, the epilogue left as Relax ops for FuseOps to fuse, scheduled later by
MetaSchedule records or the target's default rules), a library call (left as the library pass
wrote it), a hand-written or an external GEMM PrimFunc (`call_tir`, batch axes folded into
rows, the epilogue's addends passed after the operands).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import numpy as np
import tvm
from tvm import relax

from .op_kinds import OP_KINDS, Attrs, Group, OpKind, Step, find_group, static_shape

SOURCES = ("generated", "library", "handwritten", "external", "generator")

Rewrite = Callable[[relax.BlockBuilder, relax.Call], relax.Expr]
"""Emits the candidate's implementation of `call` (an op group of the candidate's signature)."""

ACTIVATIONS = {"relu": relax.op.nn.relu, "gelu": relax.op.nn.gelu}


def group_operands(call: relax.Expr, mod: tvm.IRModule | None = None) -> Group | None:
    """The op group `call` (in `mod`) is (a plain op, or a library call with its absorbed epilogue)."""
    found = find_group(call, mod)
    return None if found is None else found[1]


@dataclasses.dataclass(frozen=True)
class OpSignature:
    """An op group at static shapes: `shapes` of the op's tensor operands, of `dtype` (the
    first operand's, the output's and the addends'; the others' as the kind says:
    `operand_dtypes`), its attributes (`attrs`, e.g. attention's scale), then its `epilogue`
    steps in order;
    `weight`: the second operand is a constant (a model weight), so a kernel may take it in
    its own layout, converted at build time."""

    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    epilogue: tuple[Step, ...] = ()
    weight: bool = False
    attrs: Attrs = ()

    @classmethod
    def of_call(cls, call: relax.Expr, mod: tvm.IRModule | None = None) -> OpSignature | None:
        """The signature of `call` (in `mod`: see `find_group`), or None when selection does
        not handle it."""
        found = find_group(call, mod)
        if found is None:
            return None
        kind, group = found
        shapes = [*kind.shapes_of(group.operands), *(static_shape(arg) for arg in group.addends)]
        if None in shapes:
            return None
        operands = tuple(shapes[:len(group.operands)])
        dtype = str(group.operands[0].ty.dtype)
        expected = (*kind.operand_dtypes(dtype, group.attrs, len(operands)), *(dtype,) * len(group.addends))
        dtypes = tuple(str(arg.ty.dtype) for arg in (*group.operands, *group.addends))
        if dtypes != expected or not kind.valid(operands):
            return None
        weight = len(operands) > 1 and isinstance(group.operands[1], tvm.ir.expr.Constant)
        return cls(kind.name, operands, dtype, tuple(group.steps), weight, group.attrs)

    @property
    def kind(self) -> OpKind:
        return OP_KINDS[self.op]

    @property
    def key(self) -> str:
        """`matmul float32 1x1024 @ const 1024x4096 +4096 relu`: stable, readable, the records'
        key (`const`: a weight)."""
        steps = [f"+{'x'.join(map(str, shape))}" if kind == "add" else kind for kind, shape in self.epilogue]
        return " ".join([f"{self.op} {self.dtype}", self.kind.describe(self.shapes, self.weight), *steps,
                         *self.kind.describe_attrs(self.attrs)])

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.kind.out_shape(self.shapes, self.attrs)

    @property
    def multiply_adds(self) -> int:
        """The op's work, roughly (`OpKind.multiply_adds`)."""
        return self.kind.multiply_adds(self.shapes, self.attrs)

    @property
    def operand_dtypes(self) -> tuple[str, ...]:
        """The dtype of each tensor operand (then of each addend: `dtype`)."""
        return (*self.kind.operand_dtypes(self.dtype, self.attrs, len(self.shapes)),
                *(self.dtype,) * len(self.addend_shapes))

    def cast(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Operands then addends (as `input_sets` gives them) in their dtypes."""
        return [x.astype(dtype) for x, dtype in zip(arrays, self.operand_dtypes)]

    def variants(self) -> list[OpSignature]:
        """The same group at the other shapes every candidate is checked at (a rows-generic
        op's other row count)."""
        return [dataclasses.replace(self, shapes=shapes) for shapes in self.kind.variants(self.shapes)]

    @property
    def gemm(self) -> tuple[int, int, int]:
        """(M, N, K) of a matmul, batch axes folded into M."""
        a, b = self.shapes
        return math.prod(a[:-1]), b[1], b[0]

    @property
    def addend_shapes(self) -> list[tuple[int, ...]]:
        return [shape for kind, shape in self.epilogue if kind == "add"]

    def addends_2d(self) -> list[tuple[int, int]] | None:
        """Each addend of a matmul's epilogue as the (rows, columns) it broadcasts over in the
        (M, N) output: rows 1 or M, columns 1 or N; None when one broadcasts otherwise."""
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

    def kernel_operands(self) -> list[tuple[str, tuple[int, ...]]]:
        """The name and shape of each array a kernel from outside the compiler (external,
        generated) takes, the output last, all compact row-major: a matmul's 2-D, `a[M, K]`,
        `b[K, N]`, each addend as `addends_2d`, `c[M, N]`; a conv2d's NCHW `data`, OIHW
        `weight`, each addend at the output's rank (leading 1s), NCHW `out`; an attention's
        BSNH `q`, `k`, `v`, its `bias` (B or 1, N or 1, S or 1, T) if it has one, BSNH `out`;
        a layer norm's `x[rows, size]` (the normalized axes folded into size, the others into
        rows), `gamma[size]`, `beta[size]`, `out[rows, size]` (an RMS norm's without beta); a
        dequant_gemv's `x[rows, 1, k]`, `scales`, (`mins`,) `quants`, (`bias`,) `out[rows, 1, n]`
        (`kernel_dtypes` gives each one's dtype)."""
        aligned = [(1,) * (len(self.out_shape) - len(shape)) + shape for shape in self.addend_shapes]
        if self.op == "matmul":
            m, n, k = self.gemm
            names, operands, aligned, out = ("a", "b", "c"), [(m, k), (k, n)], self.addends_2d(), (m, n)
        elif self.op == "conv2d":
            names, operands, out = ("data", "weight", "out"), list(self.shapes), self.out_shape
        elif self.op == "attention":  # no epilogue; the bias, when there is one, an operand
            return [*zip(("q", "k", "v", "bias"), self.shapes), ("out", self.out_shape)]
        else:  # no epilogue; the op kind says (a norm's: x[rows, size], gamma[size], beta[size], out)
            return self.kind.kernel_operands(self.shapes, self.attrs)
        addends = [(f"addend{i}", shape) for i, shape in enumerate(aligned)]
        return [*zip(names[:2], operands), *addends, (names[2], out)]

    def kernel_dtypes(self) -> list[str]:
        """The dtype of each array of `kernel_operands` (the output's: `dtype`)."""
        return [*self.operand_dtypes, self.dtype]

    def kernel_buffers(self) -> tuple[list[tvm.tirx.Var], list[tvm.tirx.Buffer]]:
        """The arrays of `kernel_operands` as TIR buffers of their dtypes, and the scalars a
        kernel takes before them: for a rows-generic op its row count, a variable `rows` that
        is the leading dimension of the first operand and of the output."""
        operands, dtypes = self.kernel_operands(), self.kernel_dtypes()
        rows = [tvm.tirx.Var("rows", "int64")] if self.kind.rows_generic else []
        generic = {0, len(operands) - 1} if rows else set()
        buffers = [tvm.tirx.decl_buffer((*rows, *shape[1:]) if i in generic else shape, dtype, name)
                   for i, ((name, shape), dtype) in enumerate(zip(operands, dtypes))]
        return rows, buffers

    def edge_case(self) -> OpSignature:
        """The same op group at small shapes that are no multiple of any tile (tails everywhere)."""
        shapes = self.kind.edge_shapes(self.shapes, self.attrs)
        out, edge_out = self.out_shape, self.kind.out_shape(shapes, self.attrs)

        def edge(shape: tuple[int, ...]) -> tuple[int, ...]:
            offset = len(out) - len(shape)
            return tuple(1 if d == 1 else edge_out[offset + i] for i, d in enumerate(shape))

        epilogue = tuple((kind, edge(shape)) for kind, shape in self.epilogue)
        return dataclasses.replace(self, shapes=shapes, epilogue=epilogue)

    def emit(self, operands: Sequence[relax.Expr]) -> relax.Call:
        """The op (no epilogue) on `operands`."""
        return self.kind.emit(list(operands), self.attrs)

    def module(self, weights: Sequence[np.ndarray] = ()) -> tvm.IRModule:
        """`main(operands..., addends...)` computing the op group as plain Relax ops. With
        `weights`, the second operand is no parameter: `main` runs the group once with each of
        them as a constant (as a model's weights reach its kernels) and returns a tuple."""
        operands = [relax.Var(f"arg{i}", relax.TensorType(shape, dtype))
                    for i, (shape, dtype) in enumerate(zip(self.shapes, self.operand_dtypes))]
        addends = [relax.Var(f"addend{i}", relax.TensorType(shape, self.dtype))
                   for i, shape in enumerate(self.addend_shapes)]
        variants = [[operands[0], relax.const(w.astype(self.dtype)), *operands[2:]] for w in weights] or [operands]
        params = [operands[0], *operands[2:]] if weights else operands
        bb = relax.BlockBuilder()
        with bb.function("main", [*params, *addends]):
            with bb.dataflow():
                outs = [bb.emit(emit_epilogue(bb, bb.emit(self.emit(args)), addends, self.epilogue))
                        for args in variants]
                out = bb.emit_output(relax.Tuple(outs) if weights else outs[0])
            bb.emit_func_output(out)
        return bb.finalize()

    def input_sets(self, rng: np.random.Generator) -> dict[str, list[np.ndarray]]:
        """Operands (then epilogue addends) to check with: random normal, small integers
        (exact sums), large values (where the op's float32 result is meaningful), zeros in
        the first operand, then the op kind's own (`OpKind.own_input_sets`); or, for a kind
        that makes all of its sets itself (`OpKind.input_sets`), those."""
        own = self.kind.input_sets(self.shapes, self.attrs, rng)
        if own is not None:
            return own
        shapes = [*self.shapes, *self.addend_shapes]
        normal = [rng.standard_normal(s) for s in shapes]
        return {
            "random": normal,
            "integers": [rng.integers(-4, 5, s).astype(np.float64) for s in shapes],
            "large": [x * 1e3 if self.kind.large(i) else x for i, x in enumerate(normal)],
            "zeros": [np.zeros(shapes[0]), *normal[1:]],
            **self.kind.own_input_sets(normal, self.attrs),
        }

    def error_scale(self, operands: Sequence[np.ndarray]) -> float:
        """The magnitude an output's float32 rounding is relative to (at least 1)."""
        addends = operands[len(self.shapes):]
        return max(1.0, self.kind.error_scale_of(list(operands[:len(self.shapes)]), self.attrs),
                   *(float(np.abs(x).max(initial=0)) for x in addends))

    def reference(self, *operands: np.ndarray) -> np.ndarray:
        """What the op group computes, in float64 numpy."""
        values = [x.astype(np.float64) for x in operands]
        out = self.kind.reference(values[:len(self.shapes)], self.attrs)
        addends = iter(values[len(self.shapes):])
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
                "epilogue": [[kind, list(shape)] for kind, shape in self.epilogue], "weight": self.weight,
                "attrs": dict(self.attrs)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpSignature:
        epilogue = tuple((kind, tuple(shape)) for kind, shape in data.get("epilogue", []))
        attrs = tuple((name, float(value)) for name, value in data.get("attrs", {}).items())
        return cls(data["op"], tuple(tuple(s) for s in data["shapes"]), data["dtype"], epilogue,
                   data.get("weight", False), attrs)


_erf = np.vectorize(math.erf, otypes=[np.float64])


def emit_epilogue(bb: relax.BlockBuilder, out: relax.Expr, addends: list[relax.Expr],
                  epilogue: tuple[Step, ...] | list[Step]) -> relax.Expr:
    """`out` with the epilogue's steps applied as Relax ops (the last one not emitted)."""
    addends = iter(addends)
    for index, (kind, _) in enumerate(epilogue):
        out = bb.emit(out) if index else out
        out = relax.op.add(out, next(addends)) if kind == "add" else ACTIVATIONS[kind](out)
    return out


MAX_TASKS = 256
"""The most tasks a C kernel may split into (`CSource.tasks`)."""


@dataclasses.dataclass(frozen=True)
class CSource:
    """A kernel given as C: its source file, its function and the tasks it splits into. With
    one task the function takes the operands; with `tasks` T > 1 it takes `int64_t task,
    int64_t tasks` first and computes its share of the output, called once for each task,
    in parallel on the compiler's thread pool (the kernel starts no threads of its own)."""

    path: str
    function: str
    tasks: int = 1


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One implementation of an op signature on a target.

    source: one of SOURCES; name: unique within the source; provenance: where the code comes
    from (a file, a library function, a records directory); rewrite: emits it;
    shape_generic: it is made for any shape of the op, so verification also runs it at the
    edge-case shape; digest: a hash of its code where it lives outside the compiler (external);
    unavailable: why it cannot be built on this machine at all (then it is listed, never tried);
    kernel: for a kernel from outside the compiler (external, generator), its PrimFunc over
    `OpSignature.kernel_operands` at a signature's shapes, which verification also runs on its own
    (c poisoned beforehand, to catch outputs it leaves unwritten); c_source: for one given as
    C (`CSource`), what verification also calls directly: on operands placed against guard
    pages (to catch out-of-bounds accesses), and its tasks in different orders (races).
    """

    source: str
    name: str
    provenance: str
    rewrite: Rewrite
    shape_generic: bool = True
    digest: str = ""
    unavailable: str | None = None
    kernel: Callable[[OpSignature], tvm.tirx.PrimFunc] | None = None
    c_source: CSource | None = None

    @property
    def id(self) -> str:
        return f"{self.source}:{self.name}"


def pack_panels(bb: relax.BlockBuilder, b: relax.Expr, packed: tuple[int, int, int]) -> relax.Expr:
    """B[K, N] as `packed` = [panels, K, width]: zero-padded along N to panels x width, each
    panel's columns one contiguous run. A constant B (a weight) is packed here, once, into a
    constant (in numpy: folding Relax ops into one compiles and runs a kernel for each weight);
    any other B by Relax ops, at run time."""
    panels, k, width = packed
    n = int(b.ty.shape[1])
    if isinstance(b, tvm.ir.expr.Constant):
        weight = b.value.numpy()
        padded = np.zeros((k, panels * width), weight.dtype)
        padded[:, :n] = weight
        return relax.const(np.ascontiguousarray(padded.reshape(k, panels, width).transpose(1, 0, 2)))
    if panels * width > n:
        b = bb.emit(relax.op.nn.pad(b, [0, 0, 0, panels * width - n]))
    return bb.emit(relax.op.permute_dims(relax.op.reshape(b, (k, panels, width)), [1, 0, 2]))


def _reshaped(bb: relax.BlockBuilder, x: relax.Expr, shape: tuple[int, ...]) -> relax.Expr:
    """`x` reshaped: a constant (a bias) here, in numpy, any other by a Relax op."""
    if isinstance(x, tvm.ir.expr.Constant):
        return relax.const(x.value.numpy().reshape(shape))
    return bb.emit(relax.op.reshape(x, shape))


def call_prim_func(bb: relax.BlockBuilder, call: relax.Call, func: tvm.tirx.PrimFunc,
                   name: str, packed_b: tuple[int, int, int] | None = None) -> relax.Expr:
    """`call` (an op group) as `call_tir` of a PrimFunc over the arrays of
    `OpSignature.kernel_operands`: for a matmul a 2-D GEMM `(a[M, K], b, addends..., c[M, N])`,
    b being B[K, N] or, with `packed_b`, `pack_panels(B)`, batch axes of the first operand
    folded into M and unfolded after; for a conv2d `(data, weight, addends..., out)`; for an
    attention `(q, k, v[, bias], out)`; for a norm `(x, gamma[, beta], out)`; for a dequant_gemv
    `(x, scales, [mins,] quants, [bias,] out)` (its rows any). Each operand and addend is
    reshaped to its shape there, and the output back to the op's."""
    group = group_operands(call, bb.get())
    operands, addends = list(group.operands), group.addends
    sig = OpSignature.of_call(call, bb.get())
    arrays = sig.kernel_operands()
    # Opaque: FuseOps must not fuse into a scheduled kernel; no symbol of its own, so that
    # several shapes of one kernel in a model each get theirs from their GlobalVar.
    func = func.with_attr("op_pattern", 8).without_attr("global_symbol")
    gvar = bb.add_func(func, name)
    flat = [_reshaped(bb, x, shape) for x, (_, shape) in zip(addends, arrays[len(operands):-1])]
    if sig.op != "matmul" and sig.kind.rows_generic:  # its output the call's own (rows symbolic, maybe)
        return relax.call_tir(gvar, [*operands, *flat], call.ty)
    if sig.op != "matmul":
        args = [x if static_shape(x) == shape else bb.emit(relax.op.reshape(x, shape))
                for x, (_, shape) in zip(operands, arrays)]
        out_shape = arrays[-1][1]
        out = relax.call_tir(gvar, [*args, *flat], relax.TensorType(out_shape, sig.dtype))
        return out if out_shape == sig.out_shape else relax.op.reshape(bb.emit(out), sig.out_shape)
    (a, b), (m, n, k) = operands, sig.gemm
    b = b if packed_b is None else pack_panels(bb, b, packed_b)
    a2 = a if len(sig.shapes[0]) == 2 else bb.emit(relax.op.reshape(a, (m, k)))
    out = bb.emit(relax.call_tir(gvar, [a2, b, *flat], relax.TensorType((m, n), sig.dtype)))
    return out if len(sig.shapes[0]) == 2 else relax.op.reshape(out, call.ty.shape)
