"""More CNNs the suite does not contain, with torchvision's layer structure (torchvision has no
wheel for the installed torch): EfficientNet-B0 (SiLU, squeeze-and-excitation, 5x5 depthwise
convs), MobileNetV3-Large (hard-swish, hard-sigmoid gates, channel counts off the CPU's vector
width), SqueezeNet 1.1 (fire modules: concats of 1x1 and 3x3 expands), ShuffleNetV2 x1.0
(channel splits and shuffles, channel counts off the CPU's vector width), DenseNet-121 (dense
blocks: concats, batch norms before convs), ResNeXt-50 32x4d (grouped 3x3 convs) and
ConvNeXt-T (7x7 depthwise convs, layer norms over channels, GELU MLPs as 1x1 linears).

Each class is its torchvision namesake module for module, so parameter counts match
torchvision's (tests/test_conv_gemm_bench.py checks them); `torch_models.models()` exports
them like the others.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1, groups: int = 1,
             act: type[nn.Module] | None = nn.ReLU, eps: float = 1e-5) -> nn.Sequential:
    """torchvision.ops.Conv2dNormActivation: conv (no bias), batch norm, activation."""
    layers = [nn.Conv2d(c_in, c_out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
              nn.BatchNorm2d(c_out, eps=eps)]
    return nn.Sequential(*layers, *([act()] if act is not None else []))


class SqueezeExcitation(nn.Module):
    """torchvision.ops.SqueezeExcitation with SiLU (EfficientNet's)."""

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.fc2(F.silu(self.fc1(F.adaptive_avg_pool2d(x, 1)))))


class MBConv(nn.Module):
    """torchvision.models.efficientnet.MBConv (stochastic depth is the identity in eval)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = c_in * expand
        self.use_res_connect = stride == 1 and c_in == c_out
        layers = [] if expand == 1 else [_conv_bn(c_in, hidden, 1, act=nn.SiLU, eps=1e-3)]
        layers += [_conv_bn(hidden, hidden, kernel, stride, hidden, nn.SiLU, 1e-3),
                   SqueezeExcitation(hidden, max(1, c_in // 4)), _conv_bn(hidden, c_out, 1, act=None, eps=1e-3)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.use_res_connect else self.block(x)


class EfficientNetB0(nn.Module):
    """torchvision.models.efficientnet_b0."""

    STAGES = [(1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
              (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1)]
    # expansion, kernel, first stride, input channels, output channels, blocks

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [_conv_bn(3, 32, 3, 2, act=nn.SiLU, eps=1e-3)]
        for expand, kernel, stride, c_in, c_out, blocks in self.STAGES:
            layers += [MBConv(c_in if i == 0 else c_out, c_out, kernel, stride if i == 0 else 1, expand)
                       for i in range(blocks)]
        layers.append(_conv_bn(320, 1280, 1, act=nn.SiLU, eps=1e-3))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, 1000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


def _make_divisible(value: float, divisor: int = 8) -> int:
    """torchvision.models._utils._make_divisible: the nearest multiple of `divisor`, not 10% under."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


class HardSqueezeExcitation(SqueezeExcitation):
    """torchvision.ops.SqueezeExcitation as MobileNetV3 uses it: ReLU inside, hard-sigmoid gate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(x, 1)))))


class InvertedResidualV3(nn.Module):
    """torchvision.models.mobilenetv3.InvertedResidual."""

    def __init__(self, c_in: int, kernel: int, hidden: int, c_out: int, se: bool, hard_swish: bool,
                 stride: int) -> None:
        super().__init__()
        act = nn.Hardswish if hard_swish else nn.ReLU
        self.use_res_connect = stride == 1 and c_in == c_out
        layers = [] if hidden == c_in else [_conv_bn(c_in, hidden, 1, act=act, eps=1e-3)]
        layers.append(_conv_bn(hidden, hidden, kernel, stride, hidden, act, 1e-3))
        if se:
            layers.append(HardSqueezeExcitation(hidden, _make_divisible(hidden // 4)))
        layers.append(_conv_bn(hidden, c_out, 1, act=None, eps=1e-3))
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.use_res_connect else self.block(x)


class MobileNetV3Large(nn.Module):
    """torchvision.models.mobilenet_v3_large."""

    BLOCKS = [(16, 3, 16, 16, False, False, 1), (16, 3, 64, 24, False, False, 2), (24, 3, 72, 24, False, False, 1),
              (24, 5, 72, 40, True, False, 2), (40, 5, 120, 40, True, False, 1), (40, 5, 120, 40, True, False, 1),
              (40, 3, 240, 80, False, True, 2), (80, 3, 200, 80, False, True, 1), (80, 3, 184, 80, False, True, 1),
              (80, 3, 184, 80, False, True, 1), (80, 3, 480, 112, True, True, 1), (112, 3, 672, 112, True, True, 1),
              (112, 5, 672, 160, True, True, 2), (160, 5, 960, 160, True, True, 1), (160, 5, 960, 160, True, True, 1)]
    # input channels, kernel, expanded channels, output channels, SE, hard-swish, stride

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(_conv_bn(3, 16, 3, 2, act=nn.Hardswish, eps=1e-3),
                                      *[InvertedResidualV3(*block) for block in self.BLOCKS],
                                      _conv_bn(160, 960, 1, act=nn.Hardswish, eps=1e-3))
        self.classifier = nn.Sequential(nn.Linear(960, 1280), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(1280, 1000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


class Fire(nn.Module):
    """torchvision.models.squeezenet.Fire."""

    def __init__(self, c_in: int, squeezed: int, expanded: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(c_in, squeezed, 1)
        self.expand1x1, self.expand3x3 = nn.Conv2d(squeezed, expanded, 1), nn.Conv2d(squeezed, expanded, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.squeeze(x))
        return torch.cat([F.relu(self.expand1x1(x)), F.relu(self.expand3x3(x))], 1)


class SqueezeNet11(nn.Module):
    """torchvision.models.squeezenet1_1."""

    def __init__(self) -> None:
        super().__init__()
        pool = lambda: nn.MaxPool2d(3, 2, ceil_mode=True)  # noqa: E731
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 3, 2), nn.ReLU(), pool(), Fire(64, 16, 64), Fire(128, 16, 64), pool(),
            Fire(128, 32, 128), Fire(256, 32, 128), pool(), Fire(256, 48, 192), Fire(384, 48, 192),
            Fire(384, 64, 256), Fire(512, 64, 256))
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Conv2d(512, 1000, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.classifier(self.features(x)), 1)


class ShuffleUnit(nn.Module):
    """torchvision.models.shufflenetv2.InvertedResidual."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        half = c_out // 2
        self.stride = stride
        self.branch1 = nn.Sequential(_conv_bn(c_in, c_in, 3, stride, c_in, None), _conv_bn(c_in, half, 1)) \
            if stride > 1 else nn.Sequential()
        self.branch2 = nn.Sequential(_conv_bn(c_in if stride > 1 else half, half, 1),
                                     _conv_bn(half, half, 3, stride, half, None), _conv_bn(half, half, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            kept, x = x.chunk(2, dim=1)
            out = torch.cat((kept, self.branch2(x)), 1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), 1)
        b, c, h, w = out.shape  # the channel shuffle of two groups
        return out.view(b, 2, c // 2, h, w).transpose(1, 2).reshape(b, c, h, w)


class ShuffleNetV2(nn.Module):
    """torchvision.models.shufflenet_v2_x1_0."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.maxpool = _conv_bn(3, 24, 3, 2), nn.MaxPool2d(3, 2, 1)
        stages, c_in = [], 24
        for c_out, units in [(116, 4), (232, 8), (464, 4)]:
            stages.append(nn.Sequential(*[ShuffleUnit(c_in if i == 0 else c_out, c_out, 2 if i == 0 else 1)
                                          for i in range(units)]))
            c_in = c_out
        self.stages, self.conv5, self.fc = nn.Sequential(*stages), _conv_bn(464, 1024, 1), nn.Linear(1024, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv5(self.stages(self.maxpool(self.conv1(x)))).mean([2, 3]))


class DenseLayer(nn.Module):
    """torchvision.models.densenet._DenseLayer (growth 32, bottleneck 4 x growth)."""

    def __init__(self, c_in: int, growth: int = 32) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.BatchNorm2d(c_in), nn.Conv2d(c_in, 4 * growth, 1, bias=False)
        self.norm2, self.conv2 = nn.BatchNorm2d(4 * growth), nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(F.relu(self.norm2(self.conv1(F.relu(self.norm1(x))))))
        return torch.cat([x, y], 1)


class DenseNet121(nn.Module):
    """torchvision.models.densenet121."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                   nn.MaxPool2d(3, 2, 1)]
        channels = 64
        for i, units in enumerate([6, 12, 24, 16]):
            for _ in range(units):
                layers.append(DenseLayer(channels))
                channels += 32
            if i < 3:  # a transition halves the channels and the pixels
                layers += [nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, channels // 2, 1, bias=False),
                           nn.AvgPool2d(2, 2)]
                channels //= 2
        self.features = nn.Sequential(*layers, nn.BatchNorm2d(channels))
        self.classifier = nn.Linear(channels, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.features(x)), 1), 1))


class ResNeXtBlock(nn.Module):
    """torchvision.models.resnet.Bottleneck with 32 groups of width 4 x (width / 64)."""

    def __init__(self, c_in: int, planes: int, stride: int) -> None:
        super().__init__()
        width, c_out = planes * 2, planes * 4
        self.body = nn.Sequential(_conv_bn(c_in, width, 1), _conv_bn(width, width, 3, stride, 32),
                                  _conv_bn(width, c_out, 1, act=None))
        self.downsample = _conv_bn(c_in, c_out, 1, stride, act=None) if stride != 1 or c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + (x if self.downsample is None else self.downsample(x)))


class ResNeXt50(nn.Module):
    """torchvision.models.resnext50_32x4d."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [_conv_bn(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1)]
        c_in = 64
        for i, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)]):
            for j in range(blocks):
                layers.append(ResNeXtBlock(c_in, planes, 2 if j == 0 and i > 0 else 1))
                c_in = planes * 4
        self.features, self.fc = nn.Sequential(*layers), nn.Linear(c_in, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


class LayerNorm2d(nn.LayerNorm):
    """torchvision.models.convnext.LayerNorm2d: a layer norm over the channels of NCHW."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class CNBlock(nn.Module):
    """torchvision.models.convnext.CNBlock (stochastic depth is the identity in eval)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels, eps=1e-6)
        self.pwconv1, self.pwconv2 = nn.Linear(channels, 4 * channels), nn.Linear(4 * channels, channels)
        self.layer_scale = nn.Parameter(torch.full((channels,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        y = self.pwconv2(F.gelu(self.pwconv1(y))) * self.layer_scale
        return x + y.permute(0, 3, 1, 2)


class ConvNeXtTiny(nn.Module):
    """torchvision.models.convnext_tiny."""

    def __init__(self) -> None:
        super().__init__()
        dims, depths = [96, 192, 384, 768], [3, 3, 9, 3]
        layers: list[nn.Module] = [nn.Conv2d(3, 96, 4, 4), LayerNorm2d(96, eps=1e-6)]
        for i, (dim, depth) in enumerate(zip(dims, depths)):
            if i > 0:
                layers += [LayerNorm2d(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], dim, 2, 2)]
            layers += [CNBlock(dim) for _ in range(depth)]
        self.features = nn.Sequential(*layers)
        self.norm, self.fc = LayerNorm2d(768, eps=1e-6), nn.Linear(768, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.norm(F.adaptive_avg_pool2d(self.features(x), 1)), 1))
