"""Row-wise normalizations: softmax, layer norm, RMS norm."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.cpu import Reduction
from tvm.target import Target

from .base import CPURule


class Normalization(CPURule):
    """DLight's CPU `Reduction` rule (reductions and elementwise blocks sharing leading spatial
    axes, parallel over them, vectorized elementwise steps), with errors meaning
    'not applicable'."""

    def schedule(self, func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        return Reduction().apply(func, target, False)
