"""A suite of ONNX models built in code, for tests and benchmarks.

Every builder returns an fp32, opset-17 ``onnx.ModelProto`` with seeded random weights and a
symbolic batch dimension named ``"batch"`` on all inputs and outputs. Nothing is downloaded.
The graphs use the primitive ops that exporters (torch.onnx, tf2onnx) emit, so a compiler
sees the patterns it has to recognise (decomposed LayerNorm and GELU, Reshape/Transpose
attention heads, additive attention masks, Conv + BatchNormalization).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
BATCH = "batch"


class GraphBuilder:
    """Collects nodes and initializers, naming each one uniquely."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._counts: dict[str, int] = {}

    def _unique(self, hint: str) -> str:
        n = self._counts.get(hint, 0)
        self._counts[hint] = n + 1
        return f"{hint}_{n}"

    def const(self, value: np.ndarray | float | Sequence[int], hint: str = "const") -> str:
        """Add an initializer; Python floats become fp32 scalars, int lists become int64."""
        if isinstance(value, float):
            array = np.array(value, dtype=np.float32)
        elif isinstance(value, np.ndarray):
            array = value
        else:
            array = np.array(value, dtype=np.int64)
        name = self._unique(hint)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def normal(self, shape: Sequence[int], std: float, hint: str, mean: float = 0.0) -> str:
        """Add a normally distributed fp32 initializer."""
        array = self.rng.standard_normal(tuple(shape), dtype=np.float32) * np.float32(std)
        return self.const(array + np.float32(mean), hint)

    def uniform(self, shape: Sequence[int], low: float, high: float, hint: str) -> str:
        """Add a uniformly distributed fp32 initializer."""
        return self.const(self.rng.uniform(low, high, tuple(shape)).astype(np.float32), hint)

    def op(self, op_type: str, inputs: Sequence[str], **attrs: object) -> str:
        """Append a single-output node and return its output name."""
        out = self._unique(op_type.lower())
        self.nodes.append(
            helper.make_node(op_type, list(inputs), [out], name=f"{out}_node", **attrs)
        )
        return out

    def model(
        self,
        inputs: Sequence[tuple[str, int, Sequence[int | str]]],
        outputs: Sequence[tuple[str, str, Sequence[int | str]]],
    ) -> onnx.ModelProto:
        """Finish the graph. ``inputs``: (name, elem type, shape); ``outputs``: (tensor,
        public name, shape). Outputs are renamed through Identity nodes."""
        graph_outputs = []
        for tensor, public, shape in outputs:
            self.nodes.append(
                helper.make_node("Identity", [tensor], [public], name=f"{public}_node")
            )
            graph_outputs.append(
                helper.make_tensor_value_info(public, TensorProto.FLOAT, list(shape))
            )
        graph = helper.make_graph(
            self.nodes,
            self.name,
            [helper.make_tensor_value_info(n, t, list(s)) for n, t, s in inputs],
            graph_outputs,
            self.initializers,
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name="gimlet_tvm.models",
            ir_version=IR_VERSION,
        )
        onnx.checker.check_model(model)
        return model

    # ---- layers shared by the builders ----

    def linear(self, x: str, d_in: int, d_out: int) -> str:
        """MatMul + Add, as exporters write ``nn.Linear`` on a rank >= 2 input."""
        w = self.normal((d_in, d_out), 1.0 / math.sqrt(d_in), "linear_w")
        b = self.normal((d_out,), 0.02, "linear_b")
        return self.op("Add", [self.op("MatMul", [x, w]), b])

    def conv_bn(
        self,
        x: str,
        c_in: int,
        c_out: int,
        kernel: int,
        stride: int = 1,
        group: int = 1,
        act: str | None = "relu",
    ) -> str:
        """Conv (no bias, "same" padding) + BatchNormalization + optional Relu / Relu6."""
        fan_in = c_in // group * kernel * kernel
        w = self.normal((c_out, c_in // group, kernel, kernel), math.sqrt(2.0 / fan_in), "conv_w")
        pad = kernel // 2
        y = self.op(
            "Conv", [x, w], kernel_shape=[kernel, kernel], strides=[stride, stride],
            pads=[pad] * 4, group=group,
        )
        y = self.op(
            "BatchNormalization",
            [
                y,
                self.uniform((c_out,), 0.5, 1.0, "bn_scale"),
                self.normal((c_out,), 0.1, "bn_bias"),
                self.normal((c_out,), 0.1, "bn_mean"),
                self.uniform((c_out,), 0.5, 1.5, "bn_var"),
            ],
            epsilon=1e-5,
        )
        if act == "relu":
            return self.op("Relu", [y])
        if act == "relu6":
            return self.op("Clip", [y, self.const(0.0, "clip_min"), self.const(6.0, "clip_max")])
        return y

    def classifier(self, x: str, channels: int, classes: int) -> str:
        """GlobalAveragePool + Flatten + Gemm (transB=1, as torch exports ``nn.Linear``)."""
        y = self.op("Flatten", [self.op("GlobalAveragePool", [x])], axis=1)
        w = self.normal((classes, channels), 1.0 / math.sqrt(channels), "fc_w")
        return self.op("Gemm", [y, w, self.normal((classes,), 0.02, "fc_b")], transB=1)

    def basic_block(self, x: str, c_in: int, c_out: int, stride: int) -> str:
        """ResNet basic block: two 3x3 conv-bn, 1x1 conv-bn shortcut when the shape changes."""
        y = self.conv_bn(x, c_in, c_out, 3, stride)
        y = self.conv_bn(y, c_out, c_out, 3, act=None)
        shortcut = x
        if stride != 1 or c_in != c_out:
            shortcut = self.conv_bn(x, c_in, c_out, 1, stride, act=None)
        return self.op("Relu", [self.op("Add", [y, shortcut])])

    def layer_norm(self, x: str, hidden: int) -> str:
        """The opset-17 LayerNormalization op."""
        scale = self.uniform((hidden,), 0.8, 1.2, "ln_scale")
        return self.op(
            "LayerNormalization", [x, scale, self.normal((hidden,), 0.02, "ln_bias")],
            axis=-1, epsilon=1e-5,
        )

    def layer_norm_decomposed(self, x: str, hidden: int) -> str:
        """LayerNorm as older exporters write it: ReduceMean/Sub/Pow/Sqrt/Div chain."""
        mean = self.op("ReduceMean", [x], axes=[-1], keepdims=1)
        centered = self.op("Sub", [x, mean])
        var = self.op(
            "ReduceMean", [self.op("Pow", [centered, self.const(2.0, "two")])],
            axes=[-1], keepdims=1,
        )
        std = self.op("Sqrt", [self.op("Add", [var, self.const(1e-5, "eps")])])
        scale = self.uniform((hidden,), 0.8, 1.2, "ln_scale")
        y = self.op("Mul", [self.op("Div", [centered, std]), scale])
        return self.op("Add", [y, self.normal((hidden,), 0.02, "ln_bias")])

    def gelu_erf(self, x: str) -> str:
        """GELU written out: x * 0.5 * (1 + erf(x / sqrt(2)))."""
        erf = self.op("Erf", [self.op("Div", [x, self.const(math.sqrt(2.0), "sqrt2")])])
        y = self.op("Mul", [x, self.op("Add", [erf, self.const(1.0, "one")])])
        return self.op("Mul", [y, self.const(0.5, "half")])

    def encoder_layer(
        self, x: str, mask_bias: str, seq: int, hidden: int, heads: int, ffn: int
    ) -> str:
        """Post-LN encoder layer (BERT layout): attention, residual, LayerNormalization,
        FFN with erf GELU, residual, decomposed LayerNorm."""
        head_dim = hidden // heads
        to_heads = self.const([-1, seq, heads, head_dim], "heads_shape")

        def heads_of(t: str, perm: list[int]) -> str:
            return self.op("Transpose", [self.op("Reshape", [t, to_heads])], perm=perm)

        q = heads_of(self.linear(x, hidden, hidden), [0, 2, 1, 3])  # [b, h, s, d]
        k = heads_of(self.linear(x, hidden, hidden), [0, 2, 3, 1])  # [b, h, d, s]
        v = heads_of(self.linear(x, hidden, hidden), [0, 2, 1, 3])  # [b, h, s, d]
        scale = self.const(math.sqrt(head_dim), "scale")
        scores = self.op("Div", [self.op("MatMul", [q, k]), scale])
        probs = self.op("Softmax", [self.op("Add", [scores, mask_bias])], axis=-1)
        ctx = self.op("Transpose", [self.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
        ctx = self.op("Reshape", [ctx, self.const([-1, seq, hidden], "merge_shape")])
        x = self.layer_norm(self.op("Add", [self.linear(ctx, hidden, hidden), x]), hidden)
        h = self.linear(self.gelu_erf(self.linear(x, hidden, ffn)), ffn, hidden)
        return self.layer_norm_decomposed(self.op("Add", [h, x]), hidden)


def mlp(seed: int = 0) -> onnx.ModelProto:
    """MLP 1024-4096-4096-1024 (MatMul + Add + Relu); input ``x`` [batch, 1024]."""
    b = GraphBuilder("mlp", seed)
    dims = [1024, 4096, 4096, 1024]
    y = "x"
    for i, (d_in, d_out) in enumerate(zip(dims, dims[1:])):
        y = b.linear(y, d_in, d_out)
        if i < len(dims) - 2:
            y = b.op("Relu", [y])
    return b.model([("x", TensorProto.FLOAT, [BATCH, 1024])], [(y, "y", [BATCH, 1024])])


def _resnet(
    name: str,
    seed: int,
    image: int,
    stem: tuple[int, int],
    stages: Sequence[tuple[int, int]],
    classes: int,
) -> onnx.ModelProto:
    """ResNet with basic blocks. ``stem``: (channels, kernel), stride 2 when kernel is 7;
    ``stages``: (channels, blocks), every stage after the first starts with stride 2."""
    b = GraphBuilder(name, seed)
    channels, kernel = stem
    big_stem = kernel == 7
    y = b.conv_bn("x", 3, channels, kernel, stride=2 if big_stem else 1)
    y = b.op(
        "MaxPool", [y], kernel_shape=[3, 3] if big_stem else [2, 2], strides=[2, 2],
        pads=[1, 1, 1, 1] if big_stem else [0, 0, 0, 0],
    )
    for i, (c_out, blocks) in enumerate(stages):
        for j in range(blocks):
            stride = 2 if i > 0 and j == 0 else 1
            y = b.basic_block(y, channels, c_out, stride)
            channels = c_out
    y = b.classifier(y, channels, classes)
    return b.model(
        [("x", TensorProto.FLOAT, [BATCH, 3, image, image])], [(y, "logits", [BATCH, classes])]
    )


def resnet_cnn(seed: int = 0) -> onnx.ModelProto:
    """Small ResNet-style CNN: 3x3 stem, MaxPool, blocks 16-32-64, 10 classes;
    input ``x`` [batch, 3, 64, 64]."""
    return _resnet("resnet_cnn", seed, 64, (16, 3), [(16, 1), (32, 1), (64, 1)], 10)


def resnet18_like(seed: int = 0) -> onnx.ModelProto:
    """ResNet-18 topology (7x7/2 stem, 3x3/2 MaxPool, 2 basic blocks each of 64-128-256-512,
    1x1 downsample shortcuts), 1000 classes; input ``x`` [batch, 3, 224, 224]."""
    return _resnet(
        "resnet18_like", seed, 224, (64, 7), [(64, 2), (128, 2), (256, 2), (512, 2)], 1000
    )


def mobilenet_cnn(seed: int = 0) -> onnx.ModelProto:
    """MobileNet-v1-style CNN: 3x3/2 stem, depthwise (group=C) 3x3 + pointwise 1x1 blocks,
    BatchNormalization and Relu6 (Clip), 10 classes; input ``x`` [batch, 3, 64, 64]."""
    b = GraphBuilder("mobilenet_cnn", seed)
    y = b.conv_bn("x", 3, 16, 3, stride=2, act="relu6")
    channels = 16
    for c_out, stride in [(32, 1), (64, 2), (64, 1), (128, 2), (128, 1)]:
        y = b.conv_bn(y, channels, channels, 3, stride, group=channels, act="relu6")
        y = b.conv_bn(y, channels, c_out, 1, act="relu6")
        channels = c_out
    y = b.classifier(y, channels, 10)
    return b.model(
        [("x", TensorProto.FLOAT, [BATCH, 3, 64, 64])], [(y, "logits", [BATCH, 10])]
    )


def transformer_encoder(
    seed: int = 0,
    *,
    layers: int = 1,
    seq: int = 64,
    hidden: int = 256,
    heads: int = 4,
    ffn: int = 1024,
    name: str = "transformer_encoder",
) -> onnx.ModelProto:
    """Transformer encoder layers (see ``GraphBuilder.encoder_layer``).

    Inputs: ``x`` float embeddings [batch, seq, hidden] and ``attention_mask`` int64
    [batch, seq] (1 = token, 0 = padding), turned into an additive bias the way BERT
    exporters do (Unsqueeze, Cast, (1 - mask) * -10000). Output ``y`` [batch, seq, hidden].
    """
    b = GraphBuilder(name, seed)
    mask = b.op("Cast", [b.op("Unsqueeze", ["attention_mask", b.const([1, 2], "axes")])],
                to=TensorProto.FLOAT)
    mask_bias = b.op("Mul", [b.op("Sub", [b.const(1.0, "one"), mask]), b.const(-10000.0, "neg")])
    y = "x"
    for _ in range(layers):
        y = b.encoder_layer(y, mask_bias, seq, hidden, heads, ffn)
    return b.model(
        [
            ("x", TensorProto.FLOAT, [BATCH, seq, hidden]),
            ("attention_mask", TensorProto.INT64, [BATCH, seq]),
        ],
        [(y, "y", [BATCH, seq, hidden])],
    )


def bert_base_like(seed: int = 0) -> onnx.ModelProto:
    """BERT-base encoder stack: 12 layers, hidden 768, 12 heads, FFN 3072, seq 128.

    Takes float embeddings ``x`` [batch, 128, 768] (no embedding lookup or pooler) and
    ``attention_mask`` int64 [batch, 128]."""
    return transformer_encoder(
        seed, layers=12, seq=128, hidden=768, heads=12, ffn=3072, name="bert_base_like"
    )


InputSampler = Callable[[int, np.random.Generator], dict[str, np.ndarray]]


def _images(shape: Sequence[int]) -> InputSampler:
    """Sampler for one float input ``x`` of [batch, *shape]."""

    def sample(batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"x": rng.standard_normal((batch, *shape), dtype=np.float32)}

    return sample


def _tokens(seq: int, hidden: int) -> InputSampler:
    """Sampler for encoder inputs: embeddings and a mask with random padded tails."""

    def sample(batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        lengths = rng.integers(seq // 2, seq + 1, size=batch)
        mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
        return {
            "x": rng.standard_normal((batch, seq, hidden), dtype=np.float32),
            "attention_mask": mask,
        }

    return sample


@dataclass(frozen=True)
class ModelInfo:
    """A suite entry. ``in_tests`` is False for models too big for the test suite
    (benchmarks run every entry)."""

    name: str
    builder: Callable[[], onnx.ModelProto]
    sampler: InputSampler
    in_tests: bool = True

    def build(self) -> onnx.ModelProto:
        """Build the model (deterministic: same weights every call)."""
        return self.builder()

    def example_inputs(self, batch: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
        """Random inputs for ``batch``, keyed by graph input name, in graph input order."""
        return self.sampler(batch, np.random.default_rng(seed))


SUITE: dict[str, ModelInfo] = {
    info.name: info
    for info in [
        ModelInfo("mlp", mlp, _images([1024])),
        ModelInfo("resnet_cnn", resnet_cnn, _images([3, 64, 64])),
        ModelInfo("mobilenet_cnn", mobilenet_cnn, _images([3, 64, 64])),
        ModelInfo("transformer_encoder", transformer_encoder, _tokens(64, 256)),
        ModelInfo("bert_base_like", bert_base_like, _tokens(128, 768), in_tests=False),
        ModelInfo("resnet18_like", resnet18_like, _images([3, 224, 224]), in_tests=False),
    ]
}
