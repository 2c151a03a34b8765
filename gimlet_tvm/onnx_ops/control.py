"""Scan, unrolled: its body graph is converted once per iteration.

The number of iterations (the length of the scanned axis) must be known at import time; the
body sees the enclosing graph's values (outer scope) and may use any op the importer converts
except If (TVM's importer handles If itself, outside the converter map).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
import tvm
from onnx import numpy_helper
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from ._common import OpsetConverter, const, const_value, optional_input, reject, static_shape

_op = relax.op


def _node_outputs(bb: relax.BlockBuilder, result: Any) -> list[relax.Expr]:
    """A converter's result as the list of its outputs."""
    if isinstance(result, relax.Tuple):
        return list(result.fields)
    result = bb.normalize(result)
    if isinstance(result.ty, relax.TupleType):
        return [bb.emit(relax.TupleGetItem(result, k)) for k in range(len(result.ty.fields))]
    return [result]


def convert_graph(bb: relax.BlockBuilder, op: str, graph: onnx.GraphProto,
                  values: dict[str, relax.Expr], opset: int, params: Any) -> list[relax.Expr]:
    """The outputs of subgraph `graph` converted inline with its inputs (and any outer-scope
    names it reads) bound by `values`."""
    values = dict(values)
    for init in graph.initializer:
        values[init.name] = const(numpy_helper.to_array(init))
    convert_map = onnx_frontend._get_convert_map()
    for node in graph.node:
        if node.op_type not in convert_map or node.domain not in ("", "ai.onnx"):
            raise reject(op, f"a body with {node.op_type}")
        attr = onnx_frontend.ONNXGraphImporter._parse_attr(None, node.attribute)
        attr["tvm_custom"] = {"name": node.name, "num_outputs": len(node.output)}
        inputs = onnx_frontend.onnx_input(values[name] if name else None for name in node.input)
        result = convert_map[node.op_type].get_converter(opset)(bb, inputs, attr, params)
        outputs = _node_outputs(bb, result)
        for name, value in zip(node.output, outputs):
            values[name] = value
    return [values[output.name] for output in graph.output]


def _take(bb: relax.BlockBuilder, x: relax.Expr, index: int, axis: int) -> relax.Expr:
    return bb.emit(_op.squeeze(_op.take(x, const(np.array([index], "int64")), axis=axis), [axis]))


class Scan(OpsetConverter):
    """Scan-8 (batch axis 0, sequence axis 1, per-input directions; sequence_lens only when
    constant and full) and Scan-9+ (scan_input/output axes and directions)."""

    @classmethod
    def _convert(cls, bb, inputs, attr, params, opset):
        op = cls.__name__
        body = attr["body"]
        scans = int(attr["num_scan_inputs"])
        outer = dict(params[0])
        if opset >= 9:
            states, xs = list(inputs[:len(inputs) - scans]), list(inputs[len(inputs) - scans:])
            return relax.Tuple(_scan(bb, op, body, outer, states, xs, attr, opset, params))
        lengths = optional_input(inputs, 0)
        states, xs = list(inputs[1:len(inputs) - scans]), list(inputs[len(inputs) - scans:])
        batch = static_shape(xs[0])
        if batch is None:
            raise reject(op, "a batch size unknown at import time")
        steps = batch[1]
        if lengths is not None and not np.all(const_value(lengths) == steps):
            raise reject(op, "sequence_lens other than the full length")
        per_batch = {"scan_input_directions": attr["directions"]} if "directions" in attr else {}
        results = [_scan(bb, op, body, outer, [_take(bb, s, b, 0) for s in states],
                         [_take(bb, x, b, 0) for x in xs], per_batch, opset, params)
                   for b in range(batch[0])]
        return relax.Tuple([bb.emit(_op.stack(list(parts), axis=0)) for parts in zip(*results)])


def _scan(bb: relax.BlockBuilder, op: str, body: onnx.GraphProto, outer: dict,
          states: list, xs: list, attr: dict, opset: int, params: Any) -> list[relax.Expr]:
    """Final states and stacked scan outputs of one Scan-9 style iteration sequence."""
    axes = [int(a) for a in attr.get("scan_input_axes", [0] * len(xs))]
    directions = list(attr.get("scan_input_directions", [0] * len(xs)))
    axes = [a + x.ty.ndim if a < 0 else a for a, x in zip(axes, xs)]
    lengths = set()
    for x, axis in zip(xs, axes):
        shape = x.ty.shape
        size = shape.values[axis] if shape is not None else None
        if not isinstance(size, tvm.tirx.IntImm):
            raise reject(op, "a scan length unknown at import time")
        lengths.add(int(size))
    if len(lengths) != 1:
        raise reject(op, "scan inputs of different lengths")
    steps = lengths.pop()
    names = [i.name for i in body.input]
    per_step = []
    for t in range(steps):
        slices = [_take(bb, x, steps - 1 - t if d else t, axis)
                  for x, axis, d in zip(xs, axes, directions)]
        outputs = convert_graph(bb, op, body, {**outer, **dict(zip(names, states + slices))},
                                opset, params)
        states = outputs[:len(states)]
        per_step.append(outputs[len(states):])
    if not per_step:
        raise reject(op, "an empty scan")
    scan_outputs = list(zip(*per_step))
    out_axes = list(attr.get("scan_output_axes", [0] * len(scan_outputs)))
    out_dirs = list(attr.get("scan_output_directions", [0] * len(scan_outputs)))
    stacked = []
    for values, axis, d in zip(scan_outputs, out_axes, out_dirs):
        values = list(values)[::-1] if d else list(values)
        rank = values[0].ty.ndim + 1
        stacked.append(bb.emit(_op.stack(values, axis=axis + rank if axis < 0 else axis)))
    return states + stacked
