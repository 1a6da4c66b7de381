"""Memory of a device holding several chunks: every chunk's parameters, and every chunk's activations in flight as
its schedule's order holds them (core.chunk_schedule), at the peak over the step."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

from ...core.chunk_schedule import peak_held, rank_ops
from ...core.chunks import chunk_layout
from ...core.schedule import SPLIT_BACKWARD

if TYPE_CHECKING:
    from ...core.plan import Stage
    from .cost import CostModel


class GroupBytes(NamedTuple):
    """What each device of a device group holds at its peak (bytes)."""

    stages: list[int]  # its chunks
    devices: list[int]
    static: float  # every chunk's parameters x optimizer factor
    activations: float  # the most its chunks' micro-batch slices in flight hold at once
    once: float  # a recomputing chunk's full activations of the one slice it recomputes (the largest)

    @property
    def peak(self) -> float:
        return self.static + self.activations + self.once


def group_bytes(cm: "CostModel", stages: Sequence["Stage"], num_micro_batches: int, schedule: str
                ) -> list[GroupBytes]:
    """Per device group of ``stages`` (chunks in ``schedule``'s order), what each of its devices holds at its peak:
    each chunk keeps a micro-batch slice's saved activations (a recomputing one: its inputs) from its forward until
    its backward frees them (a split backward: until its W; a recomputing chunk runs its backward whole in B), and
    the order of the group's ops says how many of each are alive at once."""
    layout = chunk_layout([s.devices for s in stages])
    split = schedule in SPLIT_BACKWARD
    out = []
    for g, devices in enumerate(layout.groups):
        chunks = layout.stages_of(g)
        need = {i: cm.stage_bytes(*stages[i].layers, len(devices), stages[i].recompute) for i in chunks}
        ops = rank_ops(schedule, num_micro_batches, len(layout.groups), layout.chunks, g)
        held = peak_held(ops, lambda i: need[i].per_slice,
                         lambda i: "W" if split and not stages[i].recompute else "B")
        out.append(GroupBytes(chunks, list(devices), sum(n.static for n in need.values()), held,
                              max(n.once for n in need.values())))
    return out


def chunked_unfit(cm: "CostModel", stages: Sequence["Stage"], num_micro_batches: int, schedule: str,
                  memory: float) -> str:
    """Why ``stages`` (chunks under ``schedule``) do not fit in ``memory`` bytes per device ("" where they do),
    naming the device group, its chunks and the bytes."""
    for gb in group_bytes(cm, stages, num_micro_batches, schedule):
        if gb.peak > memory:
            return (f"the devices {gb.devices} (stages {gb.stages}) would hold {gb.peak / 1e9:.3g} GB (parameters x "
                    f"optimizer factor {gb.static / 1e9:.3g} GB + every chunk's activations in flight "
                    f"{(gb.activations + gb.once) / 1e9:.3g} GB) > {memory / 1e9:.3g} GB of device memory")
    return ""


def stage_memory(cm: "CostModel", stages: Sequence["Stage"], num_micro_batches: int, schedule: str) -> list[float]:
    """Per stage, the peak bytes of the devices holding it (all their chunks)."""
    out = [0.0] * len(stages)
    for gb in group_bytes(cm, stages, num_micro_batches, schedule):
        for i in gb.stages:
            out[i] = gb.peak
    return out
