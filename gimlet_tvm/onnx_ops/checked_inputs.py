"""Range, Tile and ConstantOfShape: TVM's converters, after a run-time check of the input that
sizes their output.

Given at run time, a Range delta of 0 divides by zero in the output's shape function (the
process dies of SIGFPE) and a negative repeat count or size asks for an impossible tensor;
onnxruntime rejects both. Each converter here checks its input (`_common.require`: the run
raises `InputError` naming the op) and hands the checked value to TVM's converter. Constant
inputs are left to TVM's converters as they are.
"""

from __future__ import annotations

from typing import Callable

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from ._common import OnnxOpConverter, const_value, require, static_shape

_op = relax.op


class _CheckedInput(OnnxOpConverter):
    """TVM's converter of the op of the same name, with input `checked` required to satisfy
    `holds` (elementwise) when its value is only known at run time."""

    checked: int
    problem: str

    @staticmethod
    def holds(value: relax.Expr) -> relax.Expr:
        raise NotImplementedError

    @classmethod
    def get_converter(cls, opset: int) -> Callable:
        tvm_convert = getattr(onnx_frontend, cls.__name__).get_converter(opset)

        def convert(bb, inputs, attr, params):
            value = inputs[cls.checked] if len(inputs) > cls.checked else None
            if value is not None and const_value(value) is None and static_shape(value) is not None:
                inputs = list(inputs)
                inputs[cls.checked] = require(bb, value, cls.holds(value), cls.__name__, cls.problem)
            return tvm_convert(bb, inputs, attr, params)

        return convert


def _zero(value: relax.Expr) -> relax.Expr:
    return relax.const(0, value.ty.dtype)


class Range(_CheckedInput):
    checked, problem = 2, "delta is 0"
    holds = staticmethod(lambda delta: _op.not_equal(delta, _zero(delta)))


class Tile(_CheckedInput):
    checked, problem = 1, "a repeat count is negative"
    holds = staticmethod(lambda repeats: _op.greater_equal(repeats, _zero(repeats)))


class ConstantOfShape(_CheckedInput):
    checked, problem = 0, "a size is negative"
    holds = staticmethod(lambda shape: _op.greater_equal(shape, _zero(shape)))
