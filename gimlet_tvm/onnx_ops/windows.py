"""HannWindow, HammingWindow and BlackmanWindow (opset 17) with the size constant or given at
run time (then a fresh symbolic dim): generalized cosine windows computed in float64 and
cast to output_datatype, as ONNX's reference computes them."""

from __future__ import annotations

import math

import onnx
from tvm import relax

from ._common import OnnxOpConverter, reject, scalar, scalar_dim

_op = relax.op


class _CosineWindow(OnnxOpConverter):
    """w[n] = sum_k (-1)^k coefficients[k] cos(2 pi k n / N), N = size (periodic=1) or
    size - 1 (periodic=0)."""

    coefficients: tuple[float, ...]

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        code = attr.get("output_datatype", onnx.TensorProto.FLOAT)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(code).name
        if dtype not in ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
                         "uint8", "uint16", "uint32", "uint64"):
            raise reject(cls.__name__, f"output_datatype {dtype}")
        size = scalar_dim(bb, inputs[0], "window")
        n = _op.arange(0, size, 1, "float64")
        period = _op.astype(_op.reshape(inputs[0], []), "float64")
        if not attr.get("periodic", 1):
            period = _op.subtract(period, scalar(1.0, "float64"))
        angle = bb.emit(_op.divide(_op.multiply(n, scalar(2 * math.pi, "float64")), period))
        window = scalar(cls.coefficients[0], "float64")
        for k, c in enumerate(cls.coefficients[1:], start=1):
            term = _op.multiply(_op.cos(_op.multiply(angle, scalar(float(k), "float64"))),
                                scalar((-1) ** k * c, "float64"))
            window = _op.add(window, term)
        return bb.emit(_op.astype(window, dtype))


class HannWindow(_CosineWindow):
    """HannWindow-17: 0.5 - 0.5 cos(2 pi n / N)."""

    coefficients = (0.5, 0.5)


class HammingWindow(_CosineWindow):
    """HammingWindow-17: 25/46 - 21/46 cos(2 pi n / N)."""

    coefficients = (25 / 46, 21 / 46)


class BlackmanWindow(_CosineWindow):
    """BlackmanWindow-17: 0.42 - 0.5 cos(2 pi n / N) + 0.08 cos(4 pi n / N)."""

    coefficients = (0.42, 0.5, 0.08)
