"""Models the suite does not contain, exported from torch to ONNX: torchvision's ResNet-18,
ResNet-50 and MobileNetV2, the CNNs of `torch_cnns.py` (EfficientNet-B0, MobileNetV3-Large, SqueezeNet 1.1,
ShuffleNetV2, DenseNet-121, ResNeXt-50, ConvNeXt-T), and BERT-base and GPT-2 of transformers
(random weights, seeded).

torchvision has no wheel for the installed torch, so the three CNNs are defined here with
torchvision's exact layer structure (module for module: `conv1`/`bn1`/`maxpool`/`layer1..4`/
`fc` with BasicBlock/Bottleneck, stride on the 3x3 conv as in torchvision's ResNet v1.5;
MobileNetV2's `features` of Conv-BN-ReLU6 and InvertedResidual blocks, `classifier` of Dropout
and Linear). Every model is exported at a fixed batch and sequence length with the legacy
TorchScript exporter (opset 17), as torchvision/transformers users do, and cached as one
.onnx file under ``$GIMLET_TVM_CACHE/bench-models`` (written temp-then-rename).

`benchmarks/run.py --models torch_resnet18 ...` runs them; `conv_gemm.py` takes the conv
layer shapes from these definitions (`conv_layers`).
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
import transformers
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_cnns  # noqa: E402  (benchmarks/ is not a package)

# gimlet_tvm (and so TVM) is imported only when a model is first cached: callers pin thread
# counts before that.

SEED = 0


def cache_dir() -> Path:
    """``$GIMLET_TVM_CACHE/bench-models`` (default ``~/.cache/gimlet-tvm/bench-models``)."""
    root = os.environ.get("GIMLET_TVM_CACHE", Path.home() / ".cache" / "gimlet-tvm")
    return Path(root) / "bench-models"


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(c_out)]


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock."""

    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(c_in, width, 3, stride)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = _conv_bn(width, width, 3)
        out = width * self.expansion
        self.downsample = (nn.Sequential(*_conv_bn(c_in, out, 1, stride))
                           if stride != 1 or c_in != out else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    """torchvision.models.resnet.Bottleneck (stride on the 3x3 conv: ResNet v1.5)."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * self.expansion
        self.conv1, self.bn1 = _conv_bn(c_in, width, 1)
        self.conv2, self.bn2 = _conv_bn(width, width, 3, stride)
        self.conv3, self.bn3 = _conv_bn(width, out, 1)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (nn.Sequential(*_conv_bn(c_in, out, 1, stride))
                           if stride != 1 or c_in != out else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    """torchvision.models.resnet.ResNet (1000 classes)."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: list[int]) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(3, 64, 7, 2)
        self.conv1.padding = (3, 3)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        c_in, stages = 64, []
        for index, (width, count) in enumerate(zip((64, 128, 256, 512), layers)):
            blocks = []
            for i in range(count):
                blocks.append(block(c_in, width, 2 if i == 0 and index > 0 else 1))
                c_in = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(c_in, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ConvBNReLU6(nn.Sequential):
    """torchvision.ops.Conv2dNormActivation with ReLU6, as MobileNetV2 uses it."""

    def __init__(self, c_in: int, c_out: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> None:
        super().__init__(*_conv_bn(c_in, c_out, kernel, stride, groups), nn.ReLU6(inplace=True))


class InvertedResidual(nn.Module):
    """torchvision.models.mobilenetv2.InvertedResidual."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = c_in * expand
        self.use_res_connect = stride == 1 and c_in == c_out
        layers: list[nn.Module] = [ConvBNReLU6(c_in, hidden, 1)] if expand != 1 else []
        layers += [ConvBNReLU6(hidden, hidden, 3, stride, groups=hidden), *_conv_bn(hidden, c_out, 1)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    """torchvision.models.mobilenetv2.MobileNetV2 (width 1.0, 1000 classes)."""

    SETTINGS = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                (6, 160, 3, 2), (6, 320, 1, 1)]  # expansion, channels, repeats, first stride

    def __init__(self) -> None:
        super().__init__()
        features: list[nn.Module] = [ConvBNReLU6(3, 32, stride=2)]
        c_in = 32
        for expand, c_out, repeats, stride in self.SETTINGS:
            for i in range(repeats):
                features.append(InvertedResidual(c_in, c_out, stride if i == 0 else 1, expand))
                c_in = c_out
        features.append(ConvBNReLU6(c_in, 1280, 1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=0.2), nn.Linear(1280, 1000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


class _TokensOnly(nn.Module):
    """A transformers model called with token ids alone; the mask and positions are built
    here from the ids' shape (the exporter cannot trace the ones transformers builds)."""

    def __init__(self, model: nn.Module, output: Callable[[object], torch.Tensor],
                 positions: bool) -> None:
        super().__init__()
        self.model, self.output, self.positions = model, output, positions

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        extra = {"position_ids": torch.arange(ids.shape[1]).unsqueeze(0)} if self.positions else {}
        return self.output(self.model(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      use_cache=False, **extra))


def _seeded_eval(make: Callable[[], nn.Module]) -> nn.Module:
    """`make()` with weights drawn from seed `SEED`, BatchNorm statistics randomised too (so
    that folding them is exercised), in eval mode."""
    torch.manual_seed(SEED)
    model = make()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.1, 0.1)
            module.running_var.uniform_(0.5, 1.5)
    return model.eval()


def export(model: nn.Module, example: torch.Tensor, input_name: str, output_name: str) -> onnx.ModelProto:
    """`model` exported by torch's TorchScript exporter at `example`'s fixed shape, opset 17."""
    buffer = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(model, (example,), buffer, input_names=[input_name],
                          output_names=[output_name], dynamo=False, opset_version=17)
    return onnx.load_from_string(buffer.getvalue())


def gpt2_onnx(n_embd: int = 48, n_layer: int = 2, n_head: int = 4, vocab_size: int = 211,
              tokens: int = 8) -> onnx.ModelProto:
    """A GPT-2 of transformers (random weights) exported by torch: `input_ids` [1, tokens] in,
    `logits` out."""
    config = transformers.GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                                     n_positions=max(64, tokens), vocab_size=vocab_size)
    lm = _seeded_eval(lambda: transformers.GPT2LMHeadModel(config))
    wrapped = _TokensOnly(lm, lambda out: out.logits, positions=True)
    return export(wrapped, torch.zeros(1, tokens, dtype=torch.long), "input_ids", "logits")


def bert_onnx(hidden: int = 768, layers: int = 12, heads: int = 12, intermediate: int = 3072,
              vocab_size: int = 30522, tokens: int = 128) -> onnx.ModelProto:
    """BERT of transformers (bert-base widths by default, random weights) exported by torch:
    `input_ids` [1, tokens] in, the last hidden state out."""
    config = transformers.BertConfig(hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=heads, intermediate_size=intermediate,
                                     vocab_size=vocab_size, max_position_embeddings=max(512, tokens))
    bert = _seeded_eval(lambda: transformers.BertModel(config, add_pooling_layer=False))
    wrapped = _TokensOnly(bert, lambda out: out.last_hidden_state, positions=False)
    return export(wrapped, torch.zeros(1, tokens, dtype=torch.long), "input_ids", "hidden")


@dataclass(frozen=True)
class TorchModel:
    """A torch-exported benchmark model: how to make it and a sample of its one input."""

    name: str
    make: Callable[[], onnx.ModelProto]
    input_name: str
    input_shape: tuple[int, ...]
    vocab: int | None = None  # token ids below this, for language models; else images

    def onnx(self) -> onnx.ModelProto:
        """The exported model, from the cache when there (exported and cached otherwise)."""
        path = cache_dir() / f"{self.name}-{'x'.join(map(str, self.input_shape))}-torch{torch.__version__}.onnx"
        if not path.is_file():
            from gimlet_tvm.files import atomic_path

            path.parent.mkdir(parents=True, exist_ok=True)
            model = self.make()
            with atomic_path(path, suffix=".onnx") as tmp:
                onnx.save(model, tmp)
        return onnx.load(path)

    def example_inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        if self.vocab is not None:
            return {self.input_name: rng.integers(0, self.vocab, self.input_shape, dtype=np.int64)}
        return {self.input_name: rng.standard_normal(self.input_shape).astype(np.float32)}


def _image_model(name: str, make: Callable[[], nn.Module], size: int) -> TorchModel:
    shape = (1, 3, size, size)
    return TorchModel(name, lambda: export(_seeded_eval(make), torch.zeros(shape), "image", "logits"),
                      "image", shape)


def models(image_size: int = 224, tokens: int = 128) -> dict[str, TorchModel]:
    """The torch-exported models by name, at batch 1, `image_size` pixels, `tokens` tokens
    (tests use small ones; the benchmark the defaults)."""
    entries = [
        _image_model("torch_resnet18", lambda: ResNet(BasicBlock, [2, 2, 2, 2]), image_size),
        _image_model("torch_resnet50", lambda: ResNet(Bottleneck, [3, 4, 6, 3]), image_size),
        _image_model("torch_mobilenetv2", MobileNetV2, image_size),
        _image_model("torch_efficientnet_b0", torch_cnns.EfficientNetB0, image_size),
        _image_model("torch_mobilenet_v3", torch_cnns.MobileNetV3Large, image_size),
        _image_model("torch_squeezenet", torch_cnns.SqueezeNet11, image_size),
        _image_model("torch_shufflenet_v2", torch_cnns.ShuffleNetV2, image_size),
        _image_model("torch_densenet121", torch_cnns.DenseNet121, image_size),
        _image_model("torch_resnext50", torch_cnns.ResNeXt50, image_size),
        _image_model("torch_convnext_tiny", torch_cnns.ConvNeXtTiny, image_size),
        TorchModel("torch_bert", lambda: bert_onnx(tokens=tokens), "input_ids", (1, tokens), 30522),
        TorchModel("torch_gpt2", lambda: gpt2_onnx(768, 12, 12, 50257, tokens), "input_ids",
                   (1, tokens), 50257),
    ]
    return {m.name: m for m in entries}


TORCH_MODELS = models()
"""The benchmark's sizes: 224x224 images, 128 tokens."""


@dataclass(frozen=True)
class ConvLayer:
    """One Conv2d as it runs in a network: NCHW input shape and the layer's parameters."""

    input_shape: tuple[int, int, int, int]
    out_channels: int
    kernel: int
    stride: int
    padding: int
    groups: int


def conv_layers(network: str, image_size: int = 224) -> list[ConvLayer]:
    """The distinct Conv2d layers of `network` ("resnet18", "resnet50", "mobilenetv2") at batch
    1, in the order they first run (recorded by a forward pass)."""
    make = {"resnet18": lambda: ResNet(BasicBlock, [2, 2, 2, 2]),
            "resnet50": lambda: ResNet(Bottleneck, [3, 4, 6, 3]), "mobilenetv2": MobileNetV2}[network]
    model, seen = make().eval(), {}

    def record(module: nn.Conv2d, args: tuple, _out: torch.Tensor) -> None:
        layer = ConvLayer(tuple(args[0].shape), module.out_channels, module.kernel_size[0],
                          module.stride[0], module.padding[0], module.groups)
        seen.setdefault(layer, None)

    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            module.register_forward_hook(record)
    with torch.no_grad():
        model(torch.zeros(1, 3, image_size, image_size))
    return list(seen)
