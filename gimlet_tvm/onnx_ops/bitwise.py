"""BitShift with ONNX's results at every shift amount.

A shift by the type's width or more, or by a negative amount (read as a huge unsigned one), is
undefined in C and LLVM (`shl i8 x, 9` is poison), so the plain shift gives whatever the
vector code happens to compute. ONNX (and numpy) define it: a left shift gives 0, a right
shift gives the sign fill (-1 for negative signed values, 0 otherwise).
"""

from __future__ import annotations

import numpy as np
from tvm import relax

from ._common import OnnxOpConverter, reject, text_attr


class BitShift(OnnxOpConverter):
    """`where(0 <= shift < width, x << shift | x >> shift, overflow value)`."""

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        x, shift = inputs
        direction = text_attr(attr, "direction", "")
        if direction not in ("LEFT", "RIGHT"):
            raise reject("BitShift", f"direction '{direction}'")
        dtype = str(x.ty.dtype)
        width = np.dtype(dtype).itemsize * 8
        zero = relax.const(0, dtype)
        in_range = relax.op.less(shift, relax.const(width, dtype))
        if np.dtype(dtype).kind == "i":
            in_range = relax.op.logical_and(in_range, relax.op.greater_equal(shift, zero))
        safe_shift = relax.op.where(in_range, shift, zero)
        if direction == "LEFT":
            return relax.op.where(in_range, relax.op.left_shift(x, safe_shift), zero)
        shifted = relax.op.right_shift(x, safe_shift)
        if np.dtype(dtype).kind == "u":
            return relax.op.where(in_range, shifted, zero)
        sign_fill = relax.op.where(relax.op.less(x, zero), relax.const(-1, dtype), zero)
        return relax.op.where(in_range, shifted, sign_fill)
