"""Edge cases of gimlet_tvm.onnx_ops converters, each compared against onnxruntime."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

import gimlet_tvm
from gimlet_tvm.errors import ModelImportError


def _model(nodes, inputs, outputs, initializers=(), opset=23) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "t", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _check_against_onnxruntime(model: onnx.ModelProto, feeds: dict, rtol=1e-5, atol=1e-6):
    ours = gimlet_tvm.build(model, "llvm").run(feeds)
    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    for name, want in zip(names, session.run(None, feeds)):
        np.testing.assert_allclose(ours[name], want, rtol=rtol, atol=atol)
        assert ours[name].shape == want.shape and ours[name].dtype == want.dtype


@pytest.mark.parametrize("op,fill", [("ReduceMax", -np.inf), ("ReduceMin", np.inf)])
def test_reduce_extremes_of_infinite_rows(op, fill):
    """A row of all -inf (max) / +inf (min) reduces to -inf / +inf, not the finite limit."""
    x = np.array([[fill] * 3, [1.0, fill, 2.0]], np.float32)
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    model = _model([helper.make_node(op, ["x", "axes"], ["y"], keepdims=1)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1])], [axes], 18)
    _check_against_onnxruntime(model, {"x": x})


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceLogSumExp"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_runtime_axes(op, keepdims):
    """Axes fed at run time (negative, unsorted), including an empty dimension."""
    x = np.random.default_rng(2).standard_normal((2, 0, 3, 4)).astype(np.float32)
    model = _model([helper.make_node(op, ["x", "axes"], ["y"], keepdims=keepdims)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape),
                    helper.make_tensor_value_info("axes", TensorProto.INT64, [2])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                  ["a", "b", "c", "d"][:4 - 2 * (1 - keepdims)])],
                   opset=18)
    for axes in ([-1, 1], [2, 0]):
        _check_against_onnxruntime(model, {"x": x, "axes": np.array(axes, np.int64)})


def test_reduce_runtime_axes_of_unknown_length_without_keepdims_are_refused():
    model = _model([helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                    helper.make_tensor_value_info("axes", TensorProto.INT64, ["n"])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a"])], opset=13)
    with pytest.raises(ModelImportError, match="unsupported: ReduceSum with keepdims=0 and run"):
        gimlet_tvm.build(model, "llvm")


def test_shape_arithmetic_folds_into_reshape():
    """Shape -> Gather -> Concat -> Reshape (as in expanded functions) imports and runs."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["batch"], axis=0),
        helper.make_node("Concat", ["batch", "minus_one"], ["new_shape"], axis=0),
        helper.make_node("Reshape", ["x", "new_shape"], ["y"]),
        helper.make_node("Constant", [], ["c"], value_floats=[0.5]),
        helper.make_node("Mul", ["y", "c"], ["z"]),
    ]
    inits = [helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
             helper.make_tensor("minus_one", TensorProto.INT64, [1], [-1])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
                   [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 12])], inits)
    _check_against_onnxruntime(model, {"x": np.random.rand(2, 3, 4).astype(np.float32)})


@pytest.mark.parametrize("causal,mask", [(0, None), (1, None), (0, "bool"), (1, "float")])
def test_attention_3d_gqa(causal, mask):
    """Attention-23 on 3-D inputs with grouped KV heads, causal and mask variants."""
    rng = np.random.default_rng(0)
    feeds = {"q": rng.standard_normal((2, 4, 32), np.float32),
             "k": rng.standard_normal((2, 6, 16), np.float32),
             "v": rng.standard_normal((2, 6, 16), np.float32)}
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, a.shape)
              for n, a in feeds.items()]
    if mask == "bool":
        feeds["m"] = rng.random((4, 6)) > 0.3
        inputs.append(helper.make_tensor_value_info("m", TensorProto.BOOL, [4, 6]))
    elif mask == "float":
        feeds["m"] = rng.standard_normal((4, 6)).astype(np.float32)
        inputs.append(helper.make_tensor_value_info("m", TensorProto.FLOAT, [4, 6]))
    node = helper.make_node("Attention", ["q", "k", "v"] + (["m"] if mask else []), ["y"],
                            q_num_heads=4, kv_num_heads=2, is_causal=causal)
    model = _model([node], inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 32])])
    _check_against_onnxruntime(model, feeds, rtol=1e-4, atol=1e-5)


def test_attention_fully_masked_row_is_zero():
    """A query row whose keys are all masked gives 0, not NaN."""
    q = np.ones((1, 1, 2, 4), np.float32)
    mask = np.array([[False, False], [True, False]])
    node = helper.make_node("Attention", ["q", "q", "q", "m"], ["y"])
    model = _model([node], [helper.make_tensor_value_info("q", TensorProto.FLOAT, q.shape),
                            helper.make_tensor_value_info("m", TensorProto.BOOL, [2, 2])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 2, 4])])
    y = gimlet_tvm.build(model, "llvm").run({"q": q, "m": mask})["y"]
    np.testing.assert_array_equal(y[0, 0, 0], np.zeros(4, np.float32))
    np.testing.assert_allclose(y[0, 0, 1], np.ones(4, np.float32))


@pytest.mark.parametrize("ignore_index", [-1, 7])
def test_softmax_cross_entropy_ignore_index_out_of_class_range(ignore_index):
    """An ignore_index outside [0, C) with a weight input: ignored rows add nothing."""
    rng = np.random.default_rng(1)
    labels = np.array([[0, ignore_index, 2], [ignore_index, 1, 3]], np.int64)
    feeds = {"x": rng.standard_normal((2, 4, 3), np.float32), "t": labels,
             "w": rng.random(4).astype(np.float32)}
    node = helper.make_node("SoftmaxCrossEntropyLoss", ["x", "t", "w"], ["loss", "log_prob"],
                            ignore_index=ignore_index, reduction="mean")
    model = _model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 3]),
                            helper.make_tensor_value_info("t", TensorProto.INT64, [2, 3]),
                            helper.make_tensor_value_info("w", TensorProto.FLOAT, [4])],
                   [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                    helper.make_tensor_value_info("log_prob", TensorProto.FLOAT, [2, 4, 3])])
    _check_against_onnxruntime(model, feeds)


@pytest.mark.parametrize("shape,allowzero", [([0, -1, 2], 0), ([4, 0, 0], 1), ([-1], 0)])
def test_reshape_runtime_shape(shape, allowzero):
    """Reshape to a shape fed at run time, with 0 (copy or literal) and -1 entries."""
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4) if allowzero == 0 else \
        np.zeros((0, 3, 4), np.float32)
    model = _model([helper.make_node("Reshape", ["x", "s"], ["y"], allowzero=allowzero)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape),
                    helper.make_tensor_value_info("s", TensorProto.INT64, [len(shape)])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                  ["a", "b", "c"][:len(shape)])])
    _check_against_onnxruntime(model, {"x": x, "s": np.array(shape, np.int64)})


def test_unsqueeze_runtime_axes():
    x = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32)
    model = _model([helper.make_node("Unsqueeze", ["x", "axes"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape),
                    helper.make_tensor_value_info("axes", TensorProto.INT64, [2])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, list("abcd"))])
    for axes in ([-1, 0], [1, 3]):
        _check_against_onnxruntime(model, {"x": x, "axes": np.array(axes, np.int64)})


@pytest.mark.parametrize("starts,ends,axes,steps", [
    ([-1, 1], [-100, 1000], [1, -1], [-2, 3]),   # negative step, out-of-range bounds
    ([5], [2], [0], [1]),                        # empty result
    ([0, 2], [3, -1], [0, 1], [1, 1]),
])
def test_slice_runtime_bounds(starts, ends, axes, steps):
    x = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    names = ["starts", "ends", "axes", "steps"]
    feeds = {"x": x, **{n: np.array(v, np.int64)
                        for n, v in zip(names, (starts, ends, axes, steps))}}
    model = _model([helper.make_node("Slice", ["x"] + names, ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)]
                   + [helper.make_tensor_value_info(n, TensorProto.INT64, [len(starts)])
                      for n in names],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, list("abc"))])
    _check_against_onnxruntime(model, feeds)


def test_split_runtime_sizes():
    x = np.arange(24, dtype=np.float32).reshape(2, 12)
    model = _model([helper.make_node("Split", ["x", "split"], ["a", "b", "c"], axis=-1)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape),
                    helper.make_tensor_value_info("split", TensorProto.INT64, [3])],
                   [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, n + "1"])
                    for n in "abc"])
    for split in ([5, 0, 7], [1, 2, 9]):
        _check_against_onnxruntime(model, {"x": x, "split": np.array(split, np.int64)})


def test_float8_and_int4_round_trip_at_the_api():
    """float8/int4 inputs and outputs are ml_dtypes arrays at the API (carried as bytes inside),
    casts to and from them match ml_dtypes bit for bit, and a wrong dtype is an InputError."""
    x = np.array([[0.3, -1.7, 500.0, -0.0], [1e-3, np.nan, -np.inf, 7.0]], np.float32)
    q = np.array([[-8, -1, 0, 7], [3, -5, 6, 1]], ml_dtypes.int4)
    f8 = TensorProto.FLOAT8E4M3FN
    model = _model(
        [helper.make_node("Cast", ["x"], ["x8"], to=f8),
         helper.make_node("Transpose", ["x8"], ["x8t"]),
         helper.make_node("Cast", ["x8t"], ["back"], to=TensorProto.FLOAT),
         helper.make_node("Cast", ["q"], ["q32"], to=TensorProto.FLOAT),
         helper.make_node("Cast", ["q32"], ["q4"], to=TensorProto.INT4),
         helper.make_node("Reshape", ["e", "flat"], ["e_flat"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
         helper.make_tensor_value_info("q", TensorProto.INT4, [2, 4]),
         helper.make_tensor_value_info("e", TensorProto.FLOAT8E5M2, [2, 2])],
        [helper.make_tensor_value_info("x8t", f8, [4, 2]),
         helper.make_tensor_value_info("back", TensorProto.FLOAT, [4, 2]),
         helper.make_tensor_value_info("q4", TensorProto.INT4, [2, 4]),
         helper.make_tensor_value_info("e_flat", TensorProto.FLOAT8E5M2, [4])],
        [helper.make_tensor("flat", TensorProto.INT64, [1], [4])])
    built = gimlet_tvm.build(model, "llvm")
    assert [o.dtype for o in built.outputs] == ["float8_e4m3fn", "float32", "int4", "float8_e5m2"]
    e = np.array([[1.5, -0.0], [np.inf, 57344.0]], ml_dtypes.float8_e5m2)
    x8t, back, q4, e_flat = built(x, q, e)
    want = onnx.numpy_helper.saturate_cast(x, ml_dtypes.float8_e4m3fn).T
    assert x8t.dtype == want.dtype and np.array_equal(x8t.view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(back, want.astype(np.float32))
    assert q4.dtype == q.dtype and np.array_equal(q4, q)
    assert e_flat.dtype == e.dtype
    assert np.array_equal(e_flat.view(np.uint8), e.view(np.uint8).ravel())
    with pytest.raises(gimlet_tvm.InputError, match="dtype int8, expected int4"):
        built(x, q.astype(np.int8), e)


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
@pytest.mark.parametrize("weighted", [False, True])
def test_tfidf_vectorizer_modes_with_skips(mode, weighted):
    """Unigrams and bigrams with skips into permuted output columns, with and without
    per-n-gram weights; unweighted, two n-grams share a column."""
    columns = [4, 0, 2, 1, 3, 5] if weighted else [4, 0, 2, 1, 3, 0]
    weights = {"weights": [0.5, 2.0, 1.5, 3.0, 0.25, 4.0]} if weighted else {}
    node = helper.make_node(
        "TfIdfVectorizer", ["x"], ["y"], mode=mode, min_gram_length=1, max_gram_length=2,
        max_skip_count=2, ngram_counts=[0, 3], ngram_indexes=columns,
        pool_int64s=[2, 5, 7, 5, 2, 2, 7, 7, 5], **weights)
    width = max(columns) + 1
    model = _model([node], [helper.make_tensor_value_info("x", TensorProto.INT32, [3, 9])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, width])], opset=9)
    x = np.random.default_rng(4).choice([2, 5, 7, 9], size=(3, 9)).astype(np.int32)
    _check_against_onnxruntime(model, {"x": x})


def _random_forest(rng, trees: int, depth: int, features: int, targets: int, **attrs):
    """`trees` complete binary trees of `depth` splits with random modes, features, splits."""
    nodes, leaves = 2 ** depth - 1, 2 ** depth
    true_ids, false_ids, true_leaf, false_leaf, roots = [], [], [], [], []
    for t in range(trees):
        roots.append(t * nodes)
        for i in range(nodes):
            left, right = 2 * i + 1, 2 * i + 2
            is_leaf = left >= nodes
            true_ids.append(t * leaves + left - nodes if is_leaf else t * nodes + left)
            false_ids.append(t * leaves + right - nodes if is_leaf else t * nodes + right)
            true_leaf.append(int(is_leaf))
            false_leaf.append(int(is_leaf))
    count = trees * nodes
    return helper.make_node(
        "TreeEnsemble", ["x"], ["y"], domain="ai.onnx.ml", n_targets=targets, tree_roots=roots,
        nodes_modes=helper.make_tensor("m", TensorProto.UINT8, [count], rng.integers(0, 6, count)),
        nodes_featureids=rng.integers(0, features, count).tolist(),
        nodes_splits=helper.make_tensor("s", TensorProto.FLOAT, [count], rng.normal(size=count)),
        nodes_missing_value_tracks_true=rng.integers(0, 2, count).tolist(),
        nodes_truenodeids=true_ids, nodes_falsenodeids=false_ids,
        nodes_trueleafs=true_leaf, nodes_falseleafs=false_leaf,
        leaf_targetids=rng.integers(0, targets, trees * leaves).tolist(),
        leaf_weights=helper.make_tensor("w", TensorProto.FLOAT, [trees * leaves],
                                        rng.normal(size=trees * leaves)),
        **attrs)


@pytest.mark.parametrize("aggregate", [0, 1, 2, 3])
def test_tree_ensemble_random_forest(aggregate):
    """Three random trees (every comparison mode, NaN routing), each aggregate function."""
    rng = np.random.default_rng(aggregate)
    node = _random_forest(rng, trees=3, depth=3, features=4, targets=3,
                          aggregate_function=aggregate, post_transform=0)
    graph = helper.make_graph([node], "forest", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23),
                                                    helper.make_opsetid("ai.onnx.ml", 5)])
    x = rng.normal(size=(16, 4)).astype(np.float32)
    x[rng.random((16, 4)) < 0.1] = np.nan
    _check_against_onnxruntime(model, {"x": x})
