"""Constant folding at import: a node whose inputs are all constants becomes a constant.

The value comes from ONNX's reference implementation (`onnx.reference`), so shape arithmetic
in expanded function bodies (`Shape` -> `Gather` -> `Concat` -> `Reshape`) reaches the
converters that need it as plain constants.

Every converted node's result is bound to a variable named after the node (`binding_name`),
so later stages (placement pins, reports) can name what came from which ONNX node.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from tvm import relax

from ..relax_passes.op_graph import binding_name
from ._common import const_value
from .carried import ANNOTATION

# Ops whose result is not a function of their inputs, or that carry subgraphs.
_NEVER_FOLD = frozenset({
    "Bernoulli", "Dropout", "If", "Loop", "Multinomial", "RandomNormal", "RandomNormalLike",
    "RandomUniform", "RandomUniformLike", "Scan", "SequenceMap",
})
_MAX_ELEMENTS = 1 << 20
_FOLDABLE_KINDS = "biuf"  # bool, int, uint, float (numpy's own float types only)

Converter = Callable[[relax.BlockBuilder, Sequence[Any], dict, Any], Any]


def _attribute_values(attr: dict) -> dict:
    values = {}
    for name, value in attr.items():
        if name == "tvm_custom":
            continue
        values[name] = list(value) if isinstance(value, tuple) else value
    return values


def fold(op: str, opset: int, inputs: Sequence[Any], attr: dict) -> relax.Expr | None:
    """`op` evaluated on constant `inputs` as a constant (a tuple for several outputs), or None."""
    if op in _NEVER_FOLD or not inputs or ANNOTATION in attr:  # carriers: see carried.py
        return None
    arrays = [None if x is None else const_value(x) for x in inputs]
    present = [a for a in arrays if a is not None]
    if len(present) != sum(x is not None for x in inputs) or not present:
        return None
    if any(a.dtype.kind not in _FOLDABLE_KINDS or a.size > _MAX_ELEMENTS for a in present):
        return None
    names = ["" if a is None else f"i{k}" for k, a in enumerate(arrays)]
    outputs = [f"o{k}" for k in range(attr["tvm_custom"]["num_outputs"])]
    try:
        node = onnx.helper.make_node(op, names, outputs, **_attribute_values(attr))
        graph = onnx.helper.make_graph(
            [node], "fold",
            [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype),
                                                a.shape) for n, a in zip(names, arrays) if n],
            [onnx.helper.make_empty_tensor_value_info(o) for o in outputs])
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
        with np.errstate(all="ignore"):
            results = ReferenceEvaluator(model).run(
                None, {n: a for n, a in zip(names, arrays) if n})
    except Exception:  # the reference has no kernel for it, or rejects it: convert instead
        return None
    if not all(isinstance(r, np.ndarray) and r.dtype.kind in _FOLDABLE_KINDS
               and r.size <= _MAX_ELEMENTS for r in results):
        return None
    consts = [relax.const(r, r.dtype.name) for r in results]
    return consts[0] if len(consts) == 1 else relax.Tuple(consts)


class Folding:
    """A converter entry that folds all-constant nodes and defers everything else to `base`."""

    def __init__(self, op: str, base: Any):
        self.op = op
        self.base = base

    def get_converter(self, opset: int) -> Converter:
        """The base converter for `opset`, tried after folding."""
        convert = self.base.get_converter(opset)

        def fold_or_convert(bb: relax.BlockBuilder, inputs: Sequence[Any], attr: dict,
                            params: Any) -> Any:
            folded = fold(self.op, opset, inputs, attr)
            if folded is not None:
                return folded
            node_name = attr.get("tvm_custom", {}).get("name", "")
            result = convert(bb, inputs, attr, params)
            if isinstance(result, relax.Call) and node_name:
                return bb.emit(result, name_hint=binding_name(node_name))
            return result

        return fold_or_convert
