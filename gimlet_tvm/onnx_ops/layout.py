"""SpaceToDepth in both modes ('DCR', the default, and 'CRD', which TVM's converter does not
honour): a reshape to [N, C, H/b, b, W/b, b], a transpose, a reshape to [N, C*b*b, H/b, W/b]."""

from __future__ import annotations

from tvm import relax

from ._common import OnnxOpConverter, rank_of, reject, text_attr, with_fresh_shape

_op = relax.op
_ORDER = {"DCR": [0, 3, 5, 1, 2, 4], "CRD": [0, 1, 3, 5, 2, 4]}


class SpaceToDepth(OnnxOpConverter):
    """SpaceToDepth-1/13 on 4-D NCHW input (H and W multiples of blocksize)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x = inputs[0]
        mode = text_attr(attr, "mode", "DCR")
        if rank_of(x) != 4 or mode not in _ORDER:
            raise reject(cls.__name__, f"mode={mode!r} or an input that is not 4-D")
        if getattr(x.ty.shape, "values", None) is None:
            x = with_fresh_shape(bb, x, "space_to_depth")
        n, c, h, w = x.ty.shape.values
        b = int(attr["blocksize"])
        blocks = bb.emit(_op.reshape(x, [n, c, h // b, b, w // b, b]))
        moved = bb.emit(_op.permute_dims(blocks, _ORDER[mode]))
        return bb.emit(_op.reshape(moved, [n, c * b * b, h // b, w // b]))
