"""Constant, and Shape/Size of statically shaped tensors as constants (foldable further)."""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from ._common import OnnxOpConverter, reject, static_shape


class Constant(OnnxOpConverter):
    """Every `value*` attribute form; strings and sparse values are refused."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        if "value" in attr:
            value = numpy_helper.to_array(attr["value"])
        elif "value_float" in attr or "value_floats" in attr:
            value = np.array(attr.get("value_float", attr.get("value_floats")), "float32")
        elif "value_int" in attr or "value_ints" in attr:
            value = np.array(attr.get("value_int", attr.get("value_ints")), "int64")
        else:
            raise reject("Constant", f"attribute {sorted(set(attr) - {'tvm_custom'})}")
        if value.dtype.kind not in "biuf" or value.dtype.type.__module__ != "numpy":
            raise reject("Constant", f"dtype {value.dtype}")
        return relax.const(value, value.dtype.name)


class Shape(OnnxOpConverter):
    """A constant int64 tensor when the input shape is static; TVM's converter otherwise."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        shape = static_shape(inputs[0])
        if shape is None:
            return onnx_frontend.Shape.get_converter(1)(bb, inputs, attr, params)
        return relax.const(np.array(shape, "int64"), "int64")

    @classmethod
    def _impl_v15(cls, bb, inputs, attr, params):
        shape = static_shape(inputs[0])
        if shape is None:
            return onnx_frontend.Shape.get_converter(15)(bb, inputs, attr, params)
        rank = len(shape)
        start, end = attr.get("start", 0), attr.get("end", rank)
        start, end = (min(max(x + rank if x < 0 else x, 0), rank) for x in (start, end))
        return relax.const(np.array(shape[start:end], "int64"), "int64")
