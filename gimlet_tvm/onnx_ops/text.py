"""TfIdfVectorizer over integer tokens.

Each pool n-gram's count is a sum of window comparisons: for every skip distance the n-gram
may use (unigrams only adjacent, longer n-grams every distance 1..max_skip_count+1, as the
ONNX reference counts them), the input is sliced n times at that distance and compared
element-wise with the n-gram's tokens. A constant 0/1 matrix then adds the counts into the
output columns `ngram_indexes` names, and the mode weights them.

Refused: string tokens (`pool_strings`: the runtime takes no string tensors), a sequence length
unknown at import, a pool that repeats an n-gram, weights not one per n-gram, and weights
with several n-grams counted into one column (the spec leaves that open; onnxruntime keeps
one n-gram's weight, the ONNX reference reads weights per column).
"""

from __future__ import annotations

import numpy as np
from tvm import relax

from ._common import OnnxOpConverter, as_text, const, reject, scalar, static_shape

_op = relax.op
_MODES = ("TF", "IDF", "TFIDF")


def _pool_ngrams(attr: dict) -> list[tuple[int, np.ndarray]]:
    """Per n-gram size: (index of its first n-gram in pool order, its n-grams as rows)."""
    pool = np.asarray(attr["pool_int64s"], "int64")
    starts = [int(c) for c in attr["ngram_counts"]] + [len(pool)]
    groups, ordinal = [], 0
    for size, (begin, end) in enumerate(zip(starts, starts[1:]), start=1):
        rows = pool[begin:end].reshape(-1, size)
        groups.append((ordinal, rows))
        ordinal += len(rows)
    return groups


def _window_counts(bb: relax.BlockBuilder, tokens: relax.Expr, length: int, grams: np.ndarray,
                   distances: range) -> relax.Expr:
    """How often each row of `grams` occurs in `tokens` (..., length) with its tokens
    `distance` apart, summed over `distances`: float32 (..., len(grams))."""
    size = grams.shape[1]
    total = None
    for distance in distances:
        starts = length - (size - 1) * distance
        if starts <= 0:
            continue
        match = None
        for k in range(size):
            window = _op.strided_slice(tokens, axes=[-1], begin=[k * distance], end=[k * distance + starts])
            equal = _op.equal(_op.expand_dims(window, -1), const(grams[:, k]))
            match = equal if match is None else _op.logical_and(match, equal)
        count = bb.emit(_op.sum(_op.astype(match, "float32"), axis=[-2]))
        total = count if total is None else bb.emit(_op.add(total, count))
    return total


def _column_weights(name: str, attr: dict, columns: list[int], width: int) -> relax.Expr | None:
    """The weight of each output column: that of the one n-gram counted into it (weights are
    per n-gram, as the spec and onnxruntime read them); None without weights."""
    weights = np.asarray(attr.get("weights", []), "float32")
    if not len(weights):
        return None
    if len(weights) != len(columns):
        raise reject(name, f"{len(weights)} weights for {len(columns)} n-grams")
    if len(set(columns)) != len(columns):
        raise reject(name, "weights with several n-grams counted into one output column")
    per_column = np.zeros(width, "float32")
    per_column[columns] = weights
    return const(per_column)


class TfIdfVectorizer(OnnxOpConverter):
    """TfIdfVectorizer-9 for int32/int64 tokens of static length, 1-D or (batch, length)."""

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        name = cls.__name__
        if attr.get("pool_strings"):
            raise reject(name, "string tokens (pool_strings)")
        shape = static_shape(inputs[0])
        if shape is None or len(shape) not in (1, 2):
            raise reject(name, "an input of unknown length or rank other than 1 or 2")
        mode = as_text(attr["mode"])
        if mode not in _MODES:
            raise reject(name, f"mode='{mode}'")
        lowest, highest = int(attr["min_gram_length"]), int(attr["max_gram_length"])
        skips = int(attr["max_skip_count"])
        columns = [int(i) for i in attr["ngram_indexes"]]
        groups = _pool_ngrams(attr)
        if any(len({tuple(r) for r in rows}) != len(rows) for _, rows in groups):
            raise reject(name, "a pool that repeats an n-gram")
        tokens = bb.emit(_op.astype(inputs[0], "int64"))
        counts, used = [], []
        for size, (first, rows) in enumerate(groups, start=1):
            if not lowest <= size <= highest or len(rows) == 0:
                continue
            distances = range(1, 2) if size == 1 else range(1, skips + 2)
            count = _window_counts(bb, tokens, shape[-1], rows, distances)
            if count is not None:
                counts.append(count)
                used.extend(range(first, first + len(rows)))
        width = max(columns) + 1
        out_shape = [*shape[:-1], width]
        if not counts:
            frequency = bb.emit(_op.zeros(out_shape, "float32"))
        else:
            to_columns = np.zeros((len(used), width), "float32")
            to_columns[np.arange(len(used)), [columns[j] for j in used]] = 1
            joined = counts[0] if len(counts) == 1 else _op.concat(counts, axis=-1)
            frequency = bb.emit(_op.matmul(joined, const(to_columns)))
        weight = _column_weights(name, attr, columns, width)
        if mode == "IDF":
            seen = _op.astype(_op.greater(frequency, scalar(0, "float32")), "float32")
            return bb.emit(_op.multiply(seen, weight) if weight is not None else seen)
        if mode == "TFIDF" and weight is not None:
            return bb.emit(_op.multiply(frequency, weight))
        return frequency
