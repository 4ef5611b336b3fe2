"""The project's own definitions of the zoo's vision and diffusion models.

Used where torchvision is missing (it does not import beside the CPU torch
build) and for the tiny CPU configurations, which need narrower layers than
torchvision's classes allow.  Each follows the layer structure of the
published architecture; ``width`` scales every channel count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)
    )


# ------------------------------------------------------------------- ResNet


class _Residual(nn.Module):
    """A basic (two 3x3) or bottleneck (1x1, 3x3, 1x1 at 4x) residual block."""

    def __init__(self, cin: int, width: int, stride: int, bottleneck: bool) -> None:
        super().__init__()
        cout = width * 4 if bottleneck else width
        if bottleneck:
            self.body = nn.Sequential(
                _conv_bn(cin, width, 1), nn.ReLU(),
                _conv_bn(width, width, 3, stride), nn.ReLU(),
                _conv_bn(width, cout, 1),
            )  # fmt: skip
        else:
            self.body = nn.Sequential(
                _conv_bn(cin, width, 3, stride), nn.ReLU(), _conv_bn(width, cout, 3)
            )
        self.skip = _conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()
        self.out_channels = cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


class ResNet(nn.Module):
    """ResNet-18 is ``ResNet((2, 2, 2, 2), False)``, ResNet-50 ``ResNet((3, 4, 6, 3), True)``."""

    def __init__(
        self, depths: tuple[int, ...], bottleneck: bool, width: int = 64, classes: int = 1000
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(3, width, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], width
        for stage, depth in enumerate(depths):
            for k in range(depth):
                stride = 2 if stage > 0 and k == 0 else 1
                blocks.append(_Residual(cin, width * 2**stage, stride, bottleneck))
                cin = blocks[-1].out_channels
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


# -------------------------------------------------------------- MobileNetV3


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        hidden = max(8, channels // 4)
        self.reduce, self.expand = nn.Conv2d(channels, hidden, 1), nn.Conv2d(hidden, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.expand(F.relu(self.reduce(s))))


class _InvertedResidual(nn.Module):
    def __init__(self, cin: int, hidden: int, cout: int, k: int, stride: int, se: bool, hs: bool):
        super().__init__()
        act = nn.Hardswish() if hs else nn.ReLU()
        layers = [_conv_bn(cin, hidden, 1), act] if hidden != cin else []
        layers += [_conv_bn(hidden, hidden, k, stride, groups=hidden), act]
        layers += [_SqueezeExcite(hidden)] if se else []
        layers += [_conv_bn(hidden, cout, 1)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


# MobileNetV3-Small: (kernel, expansion, out, squeeze-excite, hardswish, stride).
MOBILENET_V3_SMALL = [
    (3, 16, 16, True, False, 2),
    (3, 72, 24, False, False, 2),
    (3, 88, 24, False, False, 1),
    (5, 96, 40, True, True, 2),
    (5, 240, 40, True, True, 1),
    (5, 240, 40, True, True, 1),
    (5, 120, 48, True, True, 1),
    (5, 144, 48, True, True, 1),
    (5, 288, 96, True, True, 2),
    (5, 576, 96, True, True, 1),
    (5, 576, 96, True, True, 1),
]


class MobileNetV3(nn.Module):
    def __init__(self, scale: float = 1.0, classes: int = 1000) -> None:
        super().__init__()

        def c(n: int) -> int:
            return max(8, int(n * scale) // 8 * 8)

        layers: list[nn.Module] = [_conv_bn(3, c(16), 3, 2), nn.Hardswish()]
        cin = c(16)
        for k, hidden, cout, se, hs, stride in MOBILENET_V3_SMALL:
            layers.append(_InvertedResidual(cin, c(hidden), c(cout), k, stride, se, hs))
            cin = c(cout)
        layers += [_conv_bn(cin, c(576), 1), nn.Hardswish()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.Linear(c(576), c(1024)), nn.Hardswish(), nn.Linear(c(1024), classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


# ----------------------------------------------------------------- ConvNeXt


class _ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.gamma * self.mlp(self.norm(y))
        return x + y.permute(0, 3, 1, 2)


class _LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """ConvNeXt-T is ``ConvNeXt((3, 3, 9, 3), (96, 192, 384, 768))``."""

    def __init__(self, depths: tuple[int, ...], dims: tuple[int, ...], classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, dims[0], 4, 4), _LayerNorm2d(dims[0], eps=1e-6)]
        for stage, (depth, dim) in enumerate(zip(depths, dims)):
            if stage > 0:
                layers += [
                    _LayerNorm2d(dims[stage - 1], eps=1e-6),
                    nn.Conv2d(dims[stage - 1], dim, 2, 2),
                ]
            layers += [_ConvNeXtBlock(dim) for _ in range(depth)]
        self.features = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.features(x).mean((2, 3))))


# ---------------------------------------------------------------------- ViT


class ViT(nn.Module):
    """ViT-B/16 is ``ViT(224, 16, 768, 12, 12)``: patch embedding, class token,
    pre-norm transformer encoder, linear head."""

    def __init__(
        self, image: int, patch: int, dim: int, depth: int, heads: int, classes: int = 1000
    ) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return self.head(self.norm(self.encoder(x))[:, 0])


# ------------------------------------------------------ diffusion UNet block


class UNetBlock(nn.Module):
    """A diffusion UNet's middle block: a time-conditioned residual block
    (GroupNorm, SiLU, 3x3 convolutions) followed by spatial self-attention."""

    def __init__(self, channels: int, time_dim: int, groups: int = 32) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.time = nn.Linear(time_dim, channels)
        self.norm2 = nn.GroupNorm(groups, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm3 = nn.GroupNorm(groups, channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x))) + self.time(F.silu(t))[:, :, None, None]
        x = x + self.conv2(F.silu(self.norm2(h)))
        b, c, hh, ww = x.shape
        q, k, v = self.qkv(self.norm3(x)).reshape(b, 3, c, hh * ww).unbind(1)
        attn = torch.softmax(q.transpose(1, 2) @ k / c**0.5, -1)
        return x + self.proj((v @ attn.transpose(1, 2)).reshape(b, c, hh, ww))
