"""Small models whose layer boundaries carry what is not batch rows: a position bias without a batch dimension (sent
whole, as T5's), and rows of every sequence flattened together (a boundary no plan may cut)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BiasBlock(nn.Module):
    """Mixing over the sequence with a (1, T, T) bias; the first block makes the bias from its table."""

    def __init__(self, d: int, t_max: int, makes: bool):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.table = nn.Parameter(torch.randn(t_max, t_max) * 0.3) if makes else None

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is not None:
            t = x.shape[1]
            # (1, T, T): parameters and a size, no batch rows; dropout (p=0) keeps it from being copied into every
            # layer that reads it, so it crosses the cut as T5's relative position bias does
            bias = F.dropout(self.table[:t, :t], 0.0, self.training).unsqueeze(0)
        w = torch.softmax(x @ x.transpose(1, 2) / 4 + bias, -1)  # (B, T, T)
        return x + w @ torch.tanh(self.fc(x)), bias


class BiasNet(nn.Module):
    """(B, T, 4) -> (B, T, 3); layers embed, blocks.0-2, head; the bias made in blocks.0 is read by blocks.1-2."""

    def __init__(self, d: int = 8, t_max: int = 16, blocks: int = 3):
        super().__init__()
        self.embed, self.head = nn.Linear(4, d), nn.Linear(d, 3)
        self.blocks = nn.ModuleList([BiasBlock(d, t_max, i == 0) for i in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, bias = self.embed(x), None
        for b in self.blocks:
            h, bias = b(h, bias)
        return self.head(h)


class Flat(nn.Module):
    """(B, T, C) -> (B * T, C): every row of every sequence together."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(h.flatten(0, 1)))


class Unflat(nn.Module):
    """(B * T, C) -> (B, T, C), shaped like ``like``."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return like + self.fc(flat).view_as(like)


class FlatNet(nn.Module):
    """(B, T, 4) -> (B, T, 3); layers embed, flat, unflat, head: a cut after ``flat`` would carry (B * T, 8)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.embed, self.flat, self.unflat, self.head = nn.Linear(4, d), Flat(d), Unflat(d), nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.unflat(self.flat(h), h))


def seq_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position: out (B, T, 3), y (B, T)."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten())
