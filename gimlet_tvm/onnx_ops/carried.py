"""float8/float4/int4/int2 values in an ONNX graph rewritten to their carriers before import.

TVM can neither compute with these dtypes nor hold the sub-byte ones in tensors, so the graph
TVM imports has none: inputs, outputs, initializers and `Constant`s of such dtypes become
their carrier dtype (`gimlet_tvm.carriers`), and each node reading such a value gets the
attribute `ANNOTATION` listing the ONNX dtypes of its inputs, which the converters of the ops
that interpret the values read (`input_dtypes`). Ops that only move data pass carriers
through; any other op given such a value is refused.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ..carriers import carrier, is_carried, to_carrier
from ._common import dtype_of, reject

ANNOTATION = "gimlet_input_dtypes"

# Converters that read the annotation.
_INTERPRETING = {"Cast", "CastLike", "QuantizeLinear", "DequantizeLinear", "BitCast"}
# Ops whose output holds elements of their first input, unchanged.
_PASS_THROUGH = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose",
                 "Concat", "Split", "Slice", "Gather", "Expand", "Tile"}
# Ops that read only the shape of their input.
_SHAPE_ONLY = {"Shape", "Size"}


def dtype_name(code: int) -> str:
    """The numpy/ml_dtypes name of an ONNX element type."""
    return str(onnx.helper.tensor_dtype_to_np_dtype(code))


def _carrier_code(code: int) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(carrier(dtype_name(code))))


def _carried_code(code: int) -> bool:
    return code not in (TensorProto.UNDEFINED, TensorProto.STRING) and is_carried(dtype_name(code))


def _carried_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(to_carrier(numpy_helper.to_array(tensor)), tensor.name)


def _output_codes(node: onnx.NodeProto, types: dict[str, int]) -> list[int]:
    """The element types of `node`'s outputs where they may be carried ones, else 0."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    inputs = [types.get(name, 0) for name in node.input]
    op = node.op_type
    if op in ("Cast", "BitCast"):
        return [attrs["to"]]
    if op == "CastLike":
        return [inputs[1]]
    if op == "QuantizeLinear":
        zero_point = inputs[2] if len(inputs) > 2 else 0
        return [attrs.get("output_dtype") or zero_point or TensorProto.UINT8]
    if op == "Constant" and "value" in attrs:
        return [attrs["value"].data_type]
    if op in _PASS_THROUGH and inputs:
        return [inputs[0]] * len(node.output)
    return [0] * len(node.output)


def lower(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with carried dtypes replaced by their carriers (the model itself if none)."""
    graph = model.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in graph.input}
    types.update({init.name: init.data_type for init in graph.initializer})
    annotations: dict[int, list[int]] = {}
    for index, node in enumerate(graph.node):
        codes = [types.get(name, 0) for name in node.input]
        if any(_carried_code(c) for c in codes):
            if node.op_type not in _INTERPRETING | _PASS_THROUGH | _SHAPE_ONLY:
                carried = next(dtype_name(c) for c in codes if _carried_code(c))
                raise reject(node.op_type, f"{carried} inputs")
            annotations[index] = codes
        types.update({name: code for name, code in zip(node.output, _output_codes(node, types))
                      if name})
    carried_values = any(_carried_code(c) for c in types.values())
    if not carried_values:
        return model
    for node in graph.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for a in node.attribute):
            raise reject(node.op_type, "subgraphs in a model with float8/float4/int4/int2 values")

    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    graph = lowered.graph
    for info in [*graph.input, *graph.output, *graph.value_info]:
        tensor_type = info.type.tensor_type
        if _carried_code(tensor_type.elem_type):
            tensor_type.elem_type = _carrier_code(tensor_type.elem_type)
    for init in graph.initializer:
        if _carried_code(init.data_type):
            init.CopyFrom(_carried_tensor(init))
    for index, node in enumerate(graph.node):
        for attr in node.attribute:
            if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR \
                    and _carried_code(attr.t.data_type):
                attr.t.CopyFrom(_carried_tensor(attr.t))
        if index in annotations:
            node.attribute.append(onnx.helper.make_attribute(ANNOTATION, annotations[index]))
    return lowered


def input_dtypes(op: str, inputs: Sequence[Any], attr: dict) -> list[str | None]:
    """The ONNX dtype of each input of an `op` node (None where absent): carried dtypes from
    the annotation, others from the Relax expression."""
    codes = attr.get(ANNOTATION)
    dtypes: list[str | None] = []
    for index, value in enumerate(inputs):
        if value is None:
            dtypes.append(None)
        elif codes is not None and _carried_code(codes[index]):
            dtypes.append(dtype_name(codes[index]))
        else:
            dtype = dtype_of(value)
            if is_carried(dtype):  # made by a converter of ours that knows no carriers
                raise reject(op, f"{dtype} inputs made by another op")
            dtypes.append(dtype)
    return dtypes
