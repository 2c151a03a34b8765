"""NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Written with gathers and masks rather than Relax's `nll_loss`, whose kernel reads
`weight[target]` before checking `ignore_index` (out of bounds for a negative or too large
ignore_index). Ignored targets gather class 0 and get weight 0.
"""

from __future__ import annotations

from tvm import relax

from ._common import OnnxOpConverter, dtype_of, optional_input, reject, scalar, text_attr

_op = relax.op
_REDUCTIONS = ("none", "sum", "mean")


def nll_loss(bb: relax.BlockBuilder, op: str, log_prob: relax.Expr, target: relax.Expr,
             weight: relax.Expr | None, attr: dict) -> relax.Expr:
    """ONNX NegativeLogLikelihoodLoss of `log_prob` (N, C, d1..dk) at `target` (N, d1..dk)."""
    reduction = text_attr(attr, "reduction", "mean")
    if reduction not in _REDUCTIONS:
        raise reject(op, f"reduction='{reduction}'")
    dtype = dtype_of(log_prob)
    index_dtype = dtype_of(target)
    ignore_index = attr.get("ignore_index")
    valid = None
    if ignore_index is not None:
        valid = bb.emit(_op.not_equal(target, scalar(ignore_index, index_dtype)))
        target = bb.emit(_op.where(valid, target, scalar(0, index_dtype)))
    picked = bb.emit(_op.gather_elements(log_prob, _op.expand_dims(target, 1), axis=1))
    loss = bb.emit(_op.negative(_op.squeeze(picked, [1])))
    if weight is not None:
        w = bb.emit(_op.take(weight, target, axis=0))
    else:
        w = bb.emit(_op.ones_like(loss))
    if valid is not None:
        w = bb.emit(_op.where(valid, w, scalar(0, dtype)))
    if weight is not None or valid is not None:
        loss = bb.emit(_op.multiply(loss, w))
    if reduction == "none":
        return loss
    total = bb.emit(_op.sum(loss))
    if reduction == "sum":
        return total
    return bb.emit(_op.divide(total, _op.sum(w)))


class NegativeLogLikelihoodLoss(OnnxOpConverter):
    """NegativeLogLikelihoodLoss-12/13/22: every reduction, optional weight and ignore_index."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        return nll_loss(bb, cls.__name__, inputs[0], inputs[1], optional_input(inputs, 2), attr)


class SoftmaxCrossEntropyLoss(OnnxOpConverter):
    """SoftmaxCrossEntropyLoss-12/13: NLL of log_softmax over axis 1; log_prob as 2nd output."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        log_prob = bb.emit(_op.nn.log_softmax(inputs[0], axis=1))
        loss = nll_loss(bb, cls.__name__, log_prob, inputs[1], optional_input(inputs, 2), attr)
        if attr["tvm_custom"]["num_outputs"] > 1:
            return relax.Tuple([loss, log_prob])
        return loss
