"""The op graph of a Relax `main`: what cross-device placement decides over.

Nodes are the bindings of `main` that compute: calls to Relax ops. A node producing tensors
from tensors can go on any device that supports its dtypes; a node producing shapes or other
host values, or calling opaque code (`call_tir`, packed functions), stays on the host. Tensors
flow along edges; one tensor consumed on another device is copied there once. Constants (the
weights) are not edges: they are copied to their devices once, when the model loads.
Tuple projections and aliases name a field of their producer's result: they are not nodes.
Symbolic dimensions count as `symbolic_dim` (1 unless said) when sizes are estimated.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterator

import numpy as np
import tvm
from tvm import relax

# Ops that are not kernels of their own: what they do happens on the host, around kernels.
_OPAQUE_PREFIXES = ("relax.call_", "relax.builtin.", "relax.memory.", "relax.vm.", "relax.to_vdevice",
                    "relax.hint_on_device", "relax.print", "relax.assert_op", "relax.null_value")


def reads_metadata_only(call: relax.Call) -> bool:
    """Whether `call` reads only its arguments' shapes, not their data (no copy needed)."""
    return isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.shape_of"



def binding_name(node_name: str) -> str:
    """The Relax variable name the importer binds an ONNX node's result to: its name as an
    identifier (so placement pins and reports can name ops by ONNX node)."""
    name = re.sub(r"\W", "_", node_name)
    return f"n_{name}" if name[:1].isdigit() else name


@dataclasses.dataclass
class Tensor:
    """A value that flows between nodes: `producer` is a node index, or None for a graph input."""

    var: relax.Var
    nbytes: int
    producer: int | None
    consumers: list[int] = dataclasses.field(default_factory=list)
    is_output: bool = False


@dataclasses.dataclass
class OpNode:
    """One binding of `main` that computes.

    name: the bound variable's name (the ONNX node's name where the importer kept it);
    op: the Relax op (`"matmul"`); host_only: why it must stay on the host, or None;
    flops / nbytes: work and memory traffic for the roofline; dtypes: every tensor type it
    touches; inputs: the tensors it reads (by their variable); value: the bound expression.
    """

    name: str
    op: str
    var: relax.Var
    host_only: str | None
    flops: float
    nbytes: float
    dtypes: tuple[str, ...]
    inputs: list[relax.Var] = dataclasses.field(default_factory=list)
    value: relax.Expr | None = None


@dataclasses.dataclass
class OpGraph:
    nodes: list[OpNode]
    tensors: dict[relax.Var, Tensor]

    @classmethod
    def of(cls, func: relax.Function, symbolic_dim: int = 1) -> "OpGraph":
        return _Extractor(symbolic_dim).run(func)


def tensor_types(ty) -> Iterator[relax.TensorType]:
    """The tensor types inside a (possibly nested tuple) Relax type."""
    if isinstance(ty, relax.TensorType):
        yield ty
    elif isinstance(ty, relax.TupleType):
        for field in ty.fields:
            yield from tensor_types(field)


class _Extractor:
    def __init__(self, symbolic_dim: int):
        self.symbolic_dim = symbolic_dim
        self.nodes: list[OpNode] = []
        self.tensors: dict[relax.Var, Tensor] = {}
        self.alias: dict[relax.Var, relax.Var] = {}  # projection or alias -> its tensor var

    def run(self, func: relax.Function) -> OpGraph:
        for param in func.params:
            if isinstance(param.ty, relax.TensorType):
                self.tensors[param] = Tensor(param, self.nbytes(param.ty), None)
        for block in func.body.blocks:
            for binding in block.bindings:
                self.visit(binding)
        for var in self.vars_in(func.body.body):
            self.tensors[var].is_output = True
        return OpGraph(self.nodes, self.tensors)

    def visit(self, binding: relax.Binding) -> None:
        var, value = binding.var, getattr(binding, "value", None)
        if isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var):
            source = self.resolve(value.tuple_value)
            if source in self.tensors and isinstance(var.ty, relax.TensorType):
                producer = self.tensors[source].producer
                self.tensors[var] = Tensor(var, self.nbytes(var.ty), producer)
                return
        if isinstance(value, relax.Var):
            self.alias[var] = self.resolve(value)
            return
        reads_data = value is not None and not (isinstance(value, relax.Call) and reads_metadata_only(value))
        inputs = list(dict.fromkeys(self.vars_in(value))) if reads_data else []
        op = value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else None
        outputs = list(tensor_types(var.ty))
        host_only = self.host_only(op, outputs, inputs)
        index = len(self.nodes)
        in_types = list(self.arg_types(value))
        self.nodes.append(OpNode(
            name=var.name,
            op=(op or type(value).__name__).removeprefix("relax."),
            var=var,
            host_only=host_only,
            flops=self.flops(op, value, outputs),
            nbytes=sum(self.nbytes(t) for t in [*in_types, *outputs]),
            dtypes=tuple(sorted({str(t.dtype) for t in [*in_types, *outputs]})),
            inputs=inputs,
            value=value,
        ))
        for v in inputs:
            self.tensors[v].consumers.append(index)
        if isinstance(var.ty, (relax.TensorType, relax.TupleType)):
            self.tensors[var] = Tensor(var, sum(self.nbytes(t) for t in outputs), index)

    @staticmethod
    def host_only(op: str | None, outputs: list, inputs: list) -> str | None:
        if op is None:
            return "not an op call"
        if op.startswith(_OPAQUE_PREFIXES):
            return f"{op} runs host code"
        if not outputs:
            return "computes host values (shapes or scalars)"
        if not inputs:
            return "makes a tensor from host values only"
        return None

    def vars_in(self, expr) -> Iterator[relax.Var]:
        """The tensor variables `expr` reads, resolved through aliases."""
        if isinstance(expr, relax.Var):
            var = self.resolve(expr)
            if var in self.tensors:
                yield var
        elif isinstance(expr, relax.Tuple):
            for field in expr.fields:
                yield from self.vars_in(field)
        elif isinstance(expr, relax.Call):
            for arg in expr.args:
                yield from self.vars_in(arg)

    def arg_types(self, expr) -> Iterator[relax.TensorType]:
        """The tensor types of every argument of a call, weights included."""
        for arg in getattr(expr, "args", []):
            for field in arg.fields if isinstance(arg, relax.Tuple) else [arg]:
                yield from tensor_types(getattr(field, "ty", None))

    def resolve(self, var: relax.Var) -> relax.Var:
        while var in self.alias:
            var = self.alias[var]
        return var

    def dims(self, ty: relax.TensorType) -> list[int]:
        shape = getattr(ty, "shape", None)
        if shape is None or not hasattr(shape, "values"):
            return [self.symbolic_dim] * max(getattr(ty, "ndim", 0), 0)
        return [int(d) if isinstance(d, tvm.tirx.IntImm) else self.symbolic_dim for d in shape.values]

    def nbytes(self, ty: relax.TensorType) -> int:
        if str(ty.dtype) in ("", "void"):
            return 0
        return math.prod(self.dims(ty)) * max(np.dtype(str(ty.dtype)).itemsize, 1)

    def flops(self, op: str | None, value, outputs: list) -> float:
        """Arithmetic of one call: 2 per multiply-add for matmul and convolution (read from the
        weight's shape), one per element of the larger of inputs and outputs otherwise."""
        out_elems = sum(math.prod(self.dims(t)) for t in outputs)
        args = [a for a in getattr(value, "args", []) if isinstance(a.ty, relax.TensorType)]
        if op == "relax.matmul" and args:
            return 2.0 * out_elems * (self.dims(args[0].ty) or [1])[-1]
        if op is not None and op.startswith("relax.nn.conv") and len(args) > 1:
            return 2.0 * out_elems * math.prod(self.dims(args[1].ty)[1:])
        in_elems = sum(math.prod(self.dims(a.ty)) for a in args)
        return float(max(out_elems, in_elems))
