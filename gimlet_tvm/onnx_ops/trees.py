"""ai.onnx.ml TreeEnsemble as matrix arithmetic over every root-to-leaf path.

Every split of every tree is evaluated for every sample at once (features gathered, compared
in float64 as the reference does, set membership against a NaN-padded member table, NaN
routed by `nodes_missing_value_tracks_true`). A leaf is reached when all the splits on its
path went its way: a product of the split results with constant 0/1 path matrices counts the
agreeing splits, and the leaf is reached when the count is the path's length. Reached leaves'
weights are aggregated per target by a constant leaf-to-target matrix (sum, average) or a
masked minimum/maximum (0 for a target no tree reached, as onnxruntime gives; the ONNX
reference gives the dtype's extreme there).

Refused: any post_transform but NONE (the ONNX reference ignores it, and onnxruntime's
SOFTMAX and LOGISTIC results are not those functions of its untransformed output).
"""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper
from tvm import relax

from ._common import OnnxOpConverter, const, dtype_of, reject, scalar

_op = relax.op
_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)
_SUM, _AVERAGE, _MIN, _MAX = 1, 0, 2, 3
_POST_TRANSFORMS = ("NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT")


def _array(value, dtype: str) -> np.ndarray:
    """An attribute given as a TensorProto or a list, as a numpy array of `dtype`."""
    if value is None:
        return np.zeros(0, dtype)
    if hasattr(value, "dims"):
        return numpy_helper.to_array(value).astype(dtype).reshape(-1)
    return np.asarray(value, dtype).reshape(-1)


def _paths(attr: dict) -> list[tuple[int, list[tuple[int, bool]]]]:
    """Every (leaf index, [(split node, went the true way)]) of every tree."""
    true_ids, false_ids = attr["nodes_truenodeids"], attr["nodes_falsenodeids"]
    true_leaf, false_leaf = attr["nodes_trueleafs"], attr["nodes_falseleafs"]
    paths = []

    def walk(node: int, path: list[tuple[int, bool]]) -> None:
        for way, child, is_leaf in ((True, true_ids[node], true_leaf[node]),
                                    (False, false_ids[node], false_leaf[node])):
            if is_leaf:
                paths.append((int(child), path + [(node, way)]))
            else:
                walk(int(child), path + [(node, way)])

    for root in attr["tree_roots"]:
        if true_leaf[root] and false_leaf[root] and true_ids[root] == false_ids[root]:
            paths.append((int(true_ids[root]), []))  # a tree that is one leaf
        else:
            walk(int(root), [])
    return paths


def _member_table(modes: np.ndarray, attr: dict) -> np.ndarray:
    """Per split, its set members (NaN-padded); membership_values lists the sets of the
    MEMBER splits in order, each ended by a NaN."""
    values = _array(attr.get("membership_values"), "float64")
    sets, current = [], []
    for value in values:
        if np.isnan(value):
            sets.append(current)
            current = []
        else:
            current.append(value)
    members = iter(sets)
    rows = [next(members, []) if mode == _MEMBER else [] for mode in modes]
    table = np.full((len(modes), max([len(r) for r in rows] + [1])), np.nan)
    for i, row in enumerate(rows):
        table[i, :len(row)] = row
    return table


class TreeEnsemble(OnnxOpConverter):
    """TreeEnsemble (ai.onnx.ml 5): every split mode, set membership, missing values, all
    aggregate functions; no post_transform."""

    domain = "ai.onnx.ml"

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        name = "TreeEnsemble"
        post = int(attr.get("post_transform", 0))
        if post != 0:
            label = _POST_TRANSFORMS[post] if 0 <= post < len(_POST_TRANSFORMS) else post
            raise reject(name, f"post_transform={label}")
        aggregate = int(attr.get("aggregate_function", _SUM))
        if aggregate not in (_SUM, _AVERAGE, _MIN, _MAX):
            raise reject(name, f"aggregate_function={aggregate}")
        x, dtype = inputs[0], dtype_of(inputs[0])
        modes = _array(attr["nodes_modes"], "int64")
        features = _array(attr["nodes_featureids"], "int64")
        splits = _array(attr.get("nodes_splits"), "float64")
        tracks = _array(attr.get("nodes_missing_value_tracks_true"), "bool")
        if len(tracks) == 0:
            tracks = np.zeros(len(modes), bool)
        weights = _array(attr["leaf_weights"], "float64")
        targets = _array(attr["leaf_targetids"], "int64")
        n_targets = int(attr["n_targets"])

        value = bb.emit(_op.astype(_op.take(x, const(features), axis=1), "float64"))  # (B, splits)
        split = const(splits)
        by_mode = [_op.less_equal(value, split), _op.less(value, split),
                   _op.greater_equal(value, split), _op.greater(value, split),
                   _op.equal(value, split), _op.not_equal(value, split),  # NaN: NaNSafeComparisons
                   _op.max(_op.astype(_op.equal(_op.expand_dims(value, -1),
                                                const(_member_table(modes, attr))), "int8"), axis=-1)]
        went_true = by_mode[_LEQ]
        for mode in range(_LT, _MEMBER + 1):
            if (modes == mode).any():
                result = _op.astype(by_mode[mode], "bool")
                went_true = _op.where(const(modes == mode), result, went_true)
        went_true = _op.logical_or(went_true, _op.logical_and(_op.isnan(value), const(tracks)))
        went_true = bb.emit(_op.astype(went_true, "float64"))

        paths = _paths({k: list(_array(attr[k], "int64")) for k in (
            "nodes_truenodeids", "nodes_falsenodeids", "nodes_trueleafs", "nodes_falseleafs",
            "tree_roots")})
        on_true = np.zeros((len(modes), len(paths)))
        on_false = np.zeros((len(modes), len(paths)))
        for p, (_, path) in enumerate(paths):
            for node, way in path:
                (on_true if way else on_false)[node, p] = 1
        agreeing = _op.add(_op.matmul(went_true, const(on_true)),
                           _op.matmul(_op.subtract(scalar(1.0, "float64"), went_true), const(on_false)))
        lengths = const(np.array([len(path) for _, path in paths], "float64"))
        reached = bb.emit(_op.equal(agreeing, lengths))  # (B, paths)

        leaves = np.array([leaf for leaf, _ in paths], "int64")
        leaf_weight = weights[leaves]
        to_target = np.zeros((len(paths), n_targets))
        to_target[np.arange(len(paths)), targets[leaves]] = 1
        if aggregate in (_SUM, _AVERAGE):
            if aggregate == _AVERAGE:
                leaf_weight = leaf_weight / len(attr["tree_roots"])
            picked = _op.multiply(_op.astype(reached, "float64"), const(leaf_weight))
            result = _op.matmul(picked, const(to_target))
        else:  # a target no tree reached gets 0, as in onnxruntime (the reference: dtype max/min)
            mask = bb.emit(_op.logical_and(_op.expand_dims(reached, -1), const(to_target.astype(bool))))
            extreme = np.inf if aggregate == _MIN else -np.inf
            candidates = _op.where(mask, const(leaf_weight[:, None] * np.ones(n_targets)),
                                   scalar(extreme, "float64"))
            best = (_op.min if aggregate == _MIN else _op.max)(candidates, axis=[1])
            hit = _op.max(_op.astype(mask, "int8"), axis=[1])
            result = _op.where(_op.astype(hit, "bool"), best, scalar(0.0, "float64"))
        return bb.emit(_op.astype(result, dtype))
