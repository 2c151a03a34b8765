"""ai.onnx.ml ops on numeric tensors: Binarizer, ArrayFeatureExtractor."""

from __future__ import annotations

from tvm import relax

from ._common import OnnxOpConverter, dtype_of, rank_of, scalar

_op = relax.op


class Binarizer(OnnxOpConverter):
    """1 where x > threshold, else 0, in x's dtype."""

    domain = "ai.onnx.ml"

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x = inputs[0]
        threshold = scalar(float(attr.get("threshold", 0.0)), dtype_of(x))
        return _op.astype(_op.greater(x, threshold), dtype_of(x))


class ArrayFeatureExtractor(OnnxOpConverter):
    """The elements of x's last axis at the (flattened) indices; a 1-D x gives one row."""

    domain = "ai.onnx.ml"

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x, indices = inputs
        picked = _op.take(x, _op.reshape(indices, [-1]), axis=-1)
        return _op.expand_dims(picked, 0) if rank_of(x) == 1 else picked
