"""What each rank holds of a pipeline's state by original name, and which rank sends each piece to its new owner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import nn

PARAMETER, BUFFER = "parameter", "buffer"


@dataclass(frozen=True)
class Piece:
    """One tensor as the exchange describes it (no data): shape, dtype, and whether it lives on the rank's
    device (else on the CPU: e.g. Adam's ``step`` next to parameters on a GPU)."""

    shape: tuple[int, ...]
    dtype: str  # "float64"
    on_device: bool

    @classmethod
    def of(cls, t: torch.Tensor, device: torch.device) -> "Piece":
        return cls(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.device == torch.device(device))

    def empty(self, device: torch.device) -> torch.Tensor:
        """A buffer to receive it into."""
        return torch.empty(self.shape, dtype=getattr(torch, self.dtype),
                           device=device if self.on_device else torch.device("cpu"))


@dataclass(frozen=True)
class Held:
    """What one rank holds of one key (a parameter's canonical name, or a buffer's smallest name): its value and,
    for a parameter, its gradient and optimizer state (tensors travel; other values ride along here)."""

    kind: str  # PARAMETER | BUFFER
    value: Piece
    grad: Piece | None = None
    group: int | None = None  # the optimizer's param group of the parameter (None: not optimized)
    state: tuple[tuple[str, Piece], ...] = ()  # optimizer state tensors, by name, sorted
    objects: dict[str, Any] = field(default_factory=dict)  # optimizer state that is no tensor
    first_replica: bool = True  # the rank is its stage's first replica (buffers are taken from there)

    def pieces(self) -> list[Piece]:
        """The tensors that travel for this key, in the order sender and receiver both use."""
        return [self.value, *([self.grad] if self.grad is not None else []), *(p for _, p in self.state)]


def stage_state(module: nn.Module, names: Mapping[int, list[str]], canonical: Mapping[int, str]
                ) -> dict[str, tuple[str, torch.Tensor]]:
    """This stage's tensors by key -> (kind, tensor): parameters under their canonical name, buffers under their
    smallest name in the model's state_dict (``names``: id -> its names), or, not being in it (non-persistent),
    under their smallest path in the stage (which keeps the model's paths): the same keys under any plan."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for p in module.parameters():
        out[canonical[id(p)]] = (PARAMETER, p)
    paths: dict[int, list[str]] = {}
    for path, b in module.named_buffers(remove_duplicate=False):
        paths.setdefault(id(b), []).append(path)
    for b in module.buffers():
        out[min(names.get(id(b)) or paths[id(b)])] = (BUFFER, b)
    return out


def holdings(state: Mapping[str, tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer | None,
             device: torch.device, first_replica: bool) -> dict[str, Held]:
    """:class:`Held` per key of ``state`` (:func:`stage_state`), with gradients and ``optimizer``'s state."""
    group_of: dict[int, int] = {}
    if optimizer is not None:
        for i, g in enumerate(optimizer.param_groups):
            for p in g["params"]:
                group_of[id(p)] = i
    out = {}
    for key, (kind, t) in state.items():
        if kind == BUFFER:
            out[key] = Held(BUFFER, Piece.of(t, device), first_replica=first_replica)
            continue
        st = optimizer.state.get(t, {}) if optimizer is not None else {}
        tensors = tuple(sorted((k, Piece.of(v, device)) for k, v in st.items() if isinstance(v, torch.Tensor)))
        objects = {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
        out[key] = Held(PARAMETER, Piece.of(t, device), Piece.of(t.grad, device) if t.grad is not None else None,
                        group_of.get(id(t)), tensors, objects, first_replica)
    return out


def sources(holders: Sequence[Mapping[str, Held]], wants: Sequence[Sequence[str]]) -> dict[tuple[int, str], int]:
    """(receiving rank, key) -> the rank it comes from: itself where it holds the key, else one of the holders
    (spread over them by the receiving rank); a buffer always from a first replica, as a checkpoint takes it
    (replicas may differ, e.g. BatchNorm statistics).

    Raises:
        ValueError: a key some rank needs that no rank holds (the plans cut different models?).
    """
    who: dict[str, list[int]] = {}
    for r, held in enumerate(holders):
        for key, h in held.items():
            if h.kind == PARAMETER or h.first_replica:
                who.setdefault(key, []).append(r)
    out = {}
    for dst, keys in enumerate(wants):
        for key in keys:
            ranks = who.get(key)
            if not ranks:
                raise ValueError(f"replan: rank {dst} needs {key!r} under the new plan, but no rank holds it under "
                                 f"the current one (were both plans made for the same model?)")
            out[(dst, key)] = dst if dst in ranks else ranks[dst % len(ranks)]
    return out


def exchanges(src_of: Mapping[tuple[int, str], int]) -> dict[tuple[int, int], list[str]]:
    """(sending rank, receiving rank) -> its keys in sorted order, for every pair of different ranks."""
    out: dict[tuple[int, int], list[str]] = {}
    for (dst, key), src in sorted(src_of.items(), key=lambda kv: kv[0][1]):
        if src != dst:
            out.setdefault((src, dst), []).append(key)
    return out
