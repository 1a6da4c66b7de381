"""Model factories for the ``dapple`` CLI (``dapple profile examples.models:gpt --model-arg n_layer=12``).

The convention: a factory is any callable ``factory(**model_args) -> Example-like object`` reachable as
``package.module:factory`` (or ``path/to/file.py:factory``), whose result has

- ``model``: the ``nn.Module`` to profile / plan / train;
- ``batch(n) -> (inputs, targets)``: a batch of ``n`` rows; ``inputs`` is what ``model(*inputs)`` takes (a
  tensor or a tuple of tensors, rows along dim 0), ``targets`` what ``loss_fn`` takes;
- ``loss_fn(output, *targets) -> scalar tensor`` (targets: what ``batch`` returns, a tensor or a tuple), or None
  (then backward starts from ones on the output);
- optionally ``name`` (the profile's model name), ``leaf_modules`` and ``concrete_args`` (for torch.fx).

``--model-arg key=value`` on the command line becomes ``factory(key=value)`` (values parsed as Python
literals: ``n_layer=12``, ``widths=(16,32)``, ``norm='group'``). :class:`Example` below is one such object;
returning a ``types.SimpleNamespace`` with the same attributes works as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from dapple.models import GPT, EmulatedNet, ResNet, lm_loss, random_tokens


@dataclass
class Example:
    """A model with a way to make a batch of inputs and targets at any batch size, and its loss."""

    model: nn.Module
    batch: Callable[[int], tuple[Any, Any]]  # rows -> (inputs, targets)
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    name: str = ""
    leaf_modules: list = field(default_factory=list)
    concrete_args: dict | None = None


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def gpt(n_layer: int = 4, n_embd: int = 64, n_head: int = 4, vocab_size: int = 512, seq: int = 128,
        dropout: float = 0.0, tie_weights: bool = True, seed: int = 0) -> Example:
    """The built-in GPT on random next-token data: idx (B, seq) -> logits (B, seq, vocab); loss: lm_loss."""
    torch.manual_seed(seed)
    model = GPT(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size, block_size=seq,
                dropout=dropout, tie_weights=tie_weights)
    gen = _generator(seed)
    return Example(model=model, batch=lambda n: random_tokens(n, seq, vocab_size, generator=gen), loss_fn=lm_loss,
                   name=f"GPT-{n_layer}x{n_embd}")


def resnet(widths: tuple[int, ...] = (16, 32, 64), depth: int = 2, num_classes: int = 10, image_size: int = 32,
           norm: str = "batch", seed: int = 0) -> Example:
    """The built-in ResNet on random images: (B, 3, image_size, image_size) -> (B, classes); cross entropy."""
    torch.manual_seed(seed)
    model = ResNet(widths=tuple(widths), depth=depth, num_classes=num_classes, norm=norm)
    gen = _generator(seed)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn(n, 3, image_size, image_size, generator=gen)  # (n, 3, H, W)
        return images, torch.randint(0, num_classes, (n,), generator=gen)  # (n,)

    return Example(model=model, batch=batch, loss_fn=F.cross_entropy, name=f"ResNet-{len(widths)}x{depth}")


def emulated(ms_per_row: tuple[float, ...] = (0.5,) * 8, width: int = 16, num_classes: int = 4,
             seed: int = 0) -> Example:
    """Emulated-accelerator layers: layer i sleeps ``ms_per_row[i]`` ms per row forward (2x backward)."""
    torch.manual_seed(seed)
    model = EmulatedNet(list(ms_per_row), width=width, num_classes=num_classes)
    gen = _generator(seed)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, width, generator=gen)  # (n, width)
        return x, torch.randint(0, num_classes, (n,), generator=gen)  # (n,)

    return Example(model=model, batch=batch, loss_fn=F.cross_entropy, name=f"Emulated-{len(ms_per_row)}")
