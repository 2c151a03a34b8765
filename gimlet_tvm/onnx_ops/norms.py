"""LpNormalization, and BatchNormalization in training mode (batch statistics)."""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from ._common import OnnxOpConverter, dtype_of, normalize_axes, rank_of, reject, scalar

_op = relax.op


class LpNormalization(OnnxOpConverter):
    """x / ||x||_p along `axis` for p = 1 or 2; a zero norm gives 0 (as the reference)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x = inputs[0]
        p = attr.get("p", 2)
        if p not in (1, 2):
            raise reject(cls.__name__, f"p={p}")
        axis = normalize_axes([attr.get("axis", -1)], rank_of(x))
        if p == 1:
            norm = _op.sum(_op.abs(x), axis=axis, keepdims=True)
        else:
            norm = _op.sqrt(_op.sum(_op.multiply(x, x), axis=axis, keepdims=True))
        norm = bb.emit(norm)
        zero = scalar(0, dtype_of(x))
        is_zero = _op.equal(norm, zero)
        return _op.where(is_zero, zero, _op.divide(x, _op.where(is_zero, scalar(1, dtype_of(x)),
                                                                    norm)))


class BatchNormalization(OnnxOpConverter):
    """BatchNormalization-14+ with training_mode=1: normalized with the batch's mean and
    (population) variance over all axes but 1; the optional outputs are the running mean and
    variance updated with `momentum`. Half precision is computed in float32. Inference and
    older opsets go to TVM's converter."""

    @classmethod
    def get_converter(cls, opset: int):
        tvm_convert = onnx_frontend.BatchNormalization.get_converter(opset)

        def convert(bb, inputs, attr, params):
            if opset < 14 or not attr.get("training_mode", 0):
                return tvm_convert(bb, inputs, attr, params)
            return cls._training(bb, inputs, attr)

        return convert

    @classmethod
    def _training(cls, bb: relax.BlockBuilder, inputs: list, attr: dict) -> relax.Expr:
        x, scale, bias, mean, var = inputs
        dtype = dtype_of(x)
        compute = "float32" if dtype in ("float16", "bfloat16") else dtype
        rank = rank_of(x)
        axes = [a for a in range(rank) if a != 1]

        def as_channel(v: relax.Expr) -> relax.Expr:  # [C] -> [C, 1, ...] against x
            v = _op.astype(v, compute)
            return _op.expand_dims(v, list(range(1, rank - 1))) if rank > 2 else v

        data = bb.emit(_op.astype(x, compute))
        batch_mean = bb.emit(_op.mean(data, axis=axes))
        batch_var = bb.emit(_op.variance(data, axis=axes))
        eps = scalar(float(attr.get("epsilon", 1e-5)), compute)
        y = _op.add(_op.divide(_op.multiply(as_channel(scale),
                                            _op.subtract(data, as_channel(batch_mean))),
                               _op.sqrt(_op.add(as_channel(batch_var), eps))),
                    as_channel(bias))
        momentum = float(attr.get("momentum", 0.9))
        outputs = [bb.emit(_op.astype(y, dtype))]
        for running, batch in ((mean, batch_mean), (var, batch_var)):
            updated = _op.add(_op.multiply(_op.astype(running, compute), scalar(momentum, compute)),
                              _op.multiply(batch, scalar(1 - momentum, compute)))
            outputs.append(bb.emit(_op.astype(updated, dtype_of(running))))
        count = attr["tvm_custom"]["num_outputs"]
        return outputs[0] if count == 1 else relax.Tuple(outputs[:count])
