"""MatMul, Conv and Softmax with float16/bfloat16 inputs, summed as the ONNX reference does.

TVM's kernels sum half-precision values in the input dtype, rounding after every term; the
reference (numpy) sums in float32 and rounds once, so results drifted float16 steps from it.
Other dtypes convert as TVM's converters do.
"""

from __future__ import annotations

from typing import Any, Callable

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from ._common import OnnxOpConverter, dtype_of, optional_input, rank_of

_op = relax.op
_HALF = ("float16", "bfloat16")


def _tvm_converter(op: str, opset: int) -> Callable[..., Any]:
    return getattr(onnx_frontend, op).get_converter(opset)


class MatMul(OnnxOpConverter):
    """Half-precision operands: `matmul` with a float32 result, cast back."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        a, b = inputs
        if dtype_of(a) not in _HALF:
            return _tvm_converter("MatMul", 13)(bb, inputs, attr, params)
        return _op.astype(bb.emit(_op.matmul(a, b, out_dtype="float32")), dtype_of(a))


class Conv(OnnxOpConverter):
    """Half-precision operands: TVM's Conv over float32 copies, rounded back before the bias
    is added (in the input dtype, as the reference adds it)."""

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        convert = _tvm_converter("Conv", 11)
        x, weight, bias = inputs[0], inputs[1], optional_input(inputs, 2)
        if dtype_of(x) not in _HALF:
            return convert(bb, inputs, attr, params)
        widened = [bb.emit(_op.astype(t, "float32")) for t in (x, weight)]
        out = bb.emit(_op.astype(convert(bb, [*widened, None], attr, params), dtype_of(x)))
        if bias is None:
            return out
        return _op.add(out, _op.reshape(bias, [1, -1] + [1] * (rank_of(x) - 2)))


class Softmax(OnnxOpConverter):
    """Opset 13+ with half-precision input: op by op as the reference, x - max and exp in the
    input dtype, the sum in float32 rounded once, then the division."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        return _tvm_converter("Softmax", 1)(bb, inputs, attr, params)

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        x = inputs[0]
        if dtype_of(x) not in _HALF:
            return _tvm_converter("Softmax", 13)(bb, inputs, attr, params)
        axis = attr.get("axis", -1)
        shifted = bb.emit(_op.subtract(x, _op.max(x, axis=[axis], keepdims=True)))
        exp = bb.emit(_op.exp(shifted))
        total = _op.sum(_op.astype(exp, "float32"), axis=[axis], keepdims=True)
        return _op.divide(exp, bb.emit(_op.astype(total, dtype_of(x))))
