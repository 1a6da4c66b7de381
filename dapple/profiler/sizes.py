"""Byte counts: tensors crossing a cut, and what autograd saves for backward (saved-tensor hooks)."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves


def tensors(value: Any) -> list[Tensor]:
    """Every tensor in a (nested tuple/list/dict) value."""
    return [t for t in tree_leaves(value) if isinstance(t, Tensor)]


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` as they would be sent: numel x element size, each tensor counted."""
    return sum(t.numel() * t.element_size() for t in tensors(value))


def storage_of(t: Tensor) -> tuple[int, int] | None:
    """(address, bytes) of the storage behind ``t``; None for tensors without a plain storage."""
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, some subclasses
        return None
    return (s.data_ptr(), s.nbytes()) if s.nbytes() > 0 else None


def state_storages(modules: Iterable[torch.nn.Module]) -> set[int]:
    """Addresses of the storages of all parameters and buffers: model state, never counted as activations."""
    ptrs: set[int] = set()
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            if (s := storage_of(t)) is not None:
                ptrs.add(s[0])
    return ptrs


class SavedTensors:
    """Within ``with``: records the storages autograd saves for backward, each once, model state excluded.

    ``storages`` maps storage address -> bytes; ``total`` is their sum. A saved view keeps its whole
    storage alive, so the storage's bytes are what counts.
    """

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: Tensor) -> Tensor:
        s = storage_of(t)
        if s is not None and s[0] not in self.exclude:
            self.storages[s[0]] = s[1]
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def bytes_of(self, value: Any) -> int:
        """Bytes of the saved storages that back the tensors of ``value`` (0 if none was saved)."""
        ptrs = {s[0] for t in tensors(value) if (s := storage_of(t)) is not None}
        return sum(self.storages[p] for p in ptrs if p in self.storages)

    def __enter__(self) -> "SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
