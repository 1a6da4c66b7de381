"""A small ResNet-like CNN (stem, residual stages, pooled classifier) for profiling and tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(min(8, channels), channels)
    raise ValueError(f"norm must be 'batch' or 'group', got {kind!r}")


class BasicBlock(nn.Module):
    """Two 3x3 convs with a skip connection (a 1x1 projection when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1, norm: str = "batch"):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = _norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = _norm(norm, cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _norm(norm, cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, Cin, H, W) -> (B, Cout, H/s, W/s)
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        skip = x if self.down is None else self.down(x)
        return F.relu(out + skip, inplace=True)


class ResNet(nn.Module):
    """images (B, 3, H, W) -> logits (B, num_classes). ``widths`` per stage, ``depth`` blocks per stage."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), depth: int = 2, num_classes: int = 10,
                 norm: str = "batch"):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), _norm(norm, widths[0]),
                                  nn.ReLU(inplace=True))
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            for j in range(depth):
                blocks.append(BasicBlock(cin, w, stride=2 if (j == 0 and i > 0) else 1, norm=norm))
                cin = w
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))  # (B, C, H', W')
        return self.fc(torch.flatten(self.pool(x), 1))  # (B, num_classes)
