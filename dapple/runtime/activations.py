"""Activation memory actually held: bytes of the tensors autograd keeps for backward, now and at peak."""

from __future__ import annotations

from typing import Any, Iterable

import torch


class ActivationMeter:
    """``with ActivationMeter(pipe.parameters()) as m: pipe.train_step(...)``; then ``m.peak`` (bytes).

    Counts each distinct saved tensor (a view by its own bytes, so an input slice is not charged the whole
    batch it is cut from) from when autograd saves it until its graph is freed; parameters are excluded.
    Allocator statistics would include workspace and caching; this is what a schedule keeps alive.
    """

    def __init__(self, params: Iterable[torch.Tensor] = ()):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.alive: dict[tuple, list[int]] = {}  # view key -> [holders, bytes]
        self.now = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device.type == "meta" or t.untyped_storage().data_ptr() in self.params:
            return t
        key = (t.data_ptr(), tuple(t.shape), t.stride())
        entry = self.alive.setdefault(key, [0, t.numel() * t.element_size()])
        if entry[0] == 0:
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        # detached: a saved output holding itself (and so its grad_fn, which holds this) would be a reference
        # cycle, freed only by the garbage collector where a backward keeps its graph (retain_graph, split W)
        return _Held(self, key, t.detach())

    @staticmethod
    def _unpack(h: Any) -> torch.Tensor:
        return h.t if isinstance(h, _Held) else h

    def _release(self, key: tuple) -> None:
        entry = self.alive[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.alive[key]

    def __enter__(self) -> "ActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class _Held:
    """What autograd stores instead of a saved tensor: releases the meter's count when the graph frees it."""

    __slots__ = ("meter", "key", "t")

    def __init__(self, meter: ActivationMeter, key: tuple, t: torch.Tensor):
        self.meter, self.key, self.t = meter, key, t

    def __del__(self) -> None:
        self.meter._release(self.key)
