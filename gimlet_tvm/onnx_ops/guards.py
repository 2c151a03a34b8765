"""Refusals at import for cases TVM's converters would compute wrongly (found by conformance).

Each class wraps TVM's converter of the same op: `check` raises `unsupported: <op> with ...`
for the cases known to give wrong results, and everything else converts as before.
"""

from __future__ import annotations

from typing import Any, Sequence

from tvm.relax.frontend.onnx import onnx_frontend

from ._common import OnnxOpConverter, const_value, dtype_of, optional_input, reject, static_shape

class _Guarded(OnnxOpConverter):
    """TVM's converter for `cls.__name__`, called after `check`."""

    @classmethod
    def check(cls, inputs: Sequence[Any], attr: dict) -> None:
        raise NotImplementedError

    @classmethod
    def get_converter(cls, opset: int):
        convert = getattr(onnx_frontend, cls.__name__).get_converter(opset)

        def guarded(bb, inputs, attr, params):
            cls.check(inputs, attr)
            return convert(bb, inputs, attr, params)

        return guarded


class RoiAlign(_Guarded):
    """mode='max' is refused."""

    @classmethod
    def check(cls, inputs, attr):
        if attr.get("mode", b"avg") in (b"max", "max"):
            raise reject(cls.__name__, "mode='max'")
