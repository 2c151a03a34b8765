"""ConvTranspose with the output_shape attribute (TVM's converter ignores it)."""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from ._common import OnnxOpConverter, optional_input, rank_of, reject, static_shape, text_attr

_op = relax.op


def _auto_pad(attr: dict) -> str:
    return text_attr(attr, "auto_pad", "NOTSET")


class ConvTranspose(OnnxOpConverter):
    """With output_shape: pads from the spec's total padding (split by auto_pad, the odd
    unit at the end unless SAME_UPPER), a negative pad becomes zeros around the output, then
    the bias. Without it: TVM's converter."""

    @classmethod
    def get_converter(cls, opset: int):
        tvm_convert = onnx_frontend.ConvTranspose.get_converter(opset)

        def convert(bb, inputs, attr, params):
            if "output_shape" not in attr:
                return tvm_convert(bb, inputs, attr, params)
            return cls._with_output_shape(bb, inputs, attr, params, tvm_convert)

        return convert

    @classmethod
    def _with_output_shape(cls, bb, inputs, attr, params, tvm_convert):
        x, w = inputs[0], inputs[1]
        spatial = rank_of(x) - 2
        x_shape, w_shape = static_shape(x), static_shape(w)
        if x_shape is None or w_shape is None:
            raise reject(cls.__name__, "output_shape and a run-time input shape")
        output_shape = list(attr["output_shape"])[-spatial:]
        strides = list(attr.get("strides", [1] * spatial))
        dilations = list(attr.get("dilations", [1] * spatial))
        output_padding = list(attr.get("output_padding", [0] * spatial))
        kernel = list(attr.get("kernel_shape", w_shape[2:]))
        upper = _auto_pad(attr) == "SAME_UPPER"
        begin, end = [], []
        for i in range(spatial):
            total = (strides[i] * (x_shape[i + 2] - 1) + output_padding[i]
                     + (kernel[i] - 1) * dilations[i] + 1 - output_shape[i])
            first = total // 2 if upper else total - total // 2
            begin.append(first)
            end.append(total - first)
        conv_attr = {k: v for k, v in attr.items() if k not in ("output_shape", "auto_pad")}
        conv_attr["pads"] = [max(p, 0) for p in begin + end]
        y = bb.normalize(tvm_convert(bb, [x, w, None], conv_attr, params))
        if any(p < 0 for p in begin + end):
            widths = [0, 0, 0, 0] + [v for b, e in zip(begin, end)
                                     for v in (max(-b, 0), max(-e, 0))]
            y = bb.emit(_op.nn.pad(y, widths))
        bias = optional_input(inputs, 2)
        if bias is None:
            return y
        return _op.add(y, _op.reshape(bias, [1, -1] + [1] * spatial))
