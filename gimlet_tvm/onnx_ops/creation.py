"""EyeLike with its dtype attribute (TVM's converter refuses a dtype other than the input's)."""

from __future__ import annotations

import onnx
from tvm import relax

from ._common import OnnxOpConverter, dtype_of, rank_of, reject, with_fresh_shape

_op = relax.op


class EyeLike(OnnxOpConverter):
    """EyeLike-9: ones on diagonal k of a 2-D tensor shaped like the input, in the dtype
    attribute's type (default: the input's)."""

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        x = inputs[0]
        if rank_of(x) != 2:
            raise reject(cls.__name__, "an input that is not 2-D")
        dtype = dtype_of(x)
        if "dtype" in attr:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(attr["dtype"]).name
        if getattr(x.ty.shape, "values", None) is None:
            x = with_fresh_shape(bb, x, "eyelike")
        rows, cols = x.ty.shape.values
        return bb.emit(_op.eye(rows, cols, attr.get("k", 0), dtype))
