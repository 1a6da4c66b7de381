"""Chunks (virtual stages): several stages of a plan on one device group, in the loop or the V order.

A plan's stages stay in pipeline order. Stages listing the same devices form a device group; each of them is one
chunk of it, numbered in pipeline order. With P groups of v chunks each, stage s sits on group::

    loop (Megatron's interleaved placement):  s mod P                 P = 4, v = 2:  0 1 2 3 0 1 2 3
    V (ZB-V, two chunks):                     s, then 2P - 1 - s      P = 4, v = 2:  0 1 2 3 3 2 1 0

so a group holds stages g, g + P, ... (loop) or g and 2P - 1 - g (V). Groups are numbered by their first stage.
Each group keeps its own replicas (any number of devices), which all its chunks share: between chunks of different
groups rows travel by split-concat as between any two stages; between chunks of the same group (V's middle, or a
single group) they stay on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

PLACEMENTS = ("loop", "V")


def group_order(groups: int, chunks: int, placement: str) -> list[int]:
    """The device group of each stage of ``groups`` x ``chunks`` stages placed in the ``placement`` order ("loop":
    stage s on group s mod P; "V", two chunks only: s for s < P, then 2P - 1 - s)."""
    if placement == "loop":
        return [s % groups for s in range(groups * chunks)]
    if placement == "V" and chunks == 2:
        return list(range(groups)) + list(range(groups - 1, -1, -1))
    raise ValueError(f"placement: expected 'loop', or 'V' with two chunks per device group, got {placement!r} with "
                     f"{chunks} chunk(s)")


@dataclass(frozen=True)
class ChunkLayout:
    """Where a plan's stages sit (:func:`chunk_layout`).

    Attributes:
        groups: each device group's devices, in replica order; groups numbered by their first stage.
        group_of: per stage, its device group.
        placements: the orders the stages follow, of :data:`PLACEMENTS`: () with one chunk per group; one of them,
            or both (a single group of two chunks is in both orders).
    """

    groups: tuple[tuple[int, ...], ...]
    group_of: tuple[int, ...]
    placements: tuple[str, ...]

    @property
    def chunks(self) -> int:
        """v: the chunks (stages) on every device group."""
        return len(self.group_of) // len(self.groups)

    def stages_of(self, group: int) -> list[int]:
        """The stages on device group ``group``, in pipeline order (its chunks 0, 1, ...)."""
        return [s for s, g in enumerate(self.group_of) if g == group]

    def chunk_of(self, stage: int) -> int:
        """Which chunk of its device group stage ``stage`` is (0: the group's first in pipeline order)."""
        return self.group_of[:stage].count(self.group_of[stage])

    def group_of_device(self, device: int) -> int:
        """The device group holding ``device`` (ValueError if none)."""
        for g, ds in enumerate(self.groups):
            if device in ds:
                return g
        raise ValueError(f"device {device} is in no stage of this plan")

    def same_group(self, a: int, b: int) -> bool:
        """Whether stages ``a`` and ``b`` are chunks of one device group (rows between them stay on the device)."""
        return self.group_of[a] == self.group_of[b]


def chunk_layout(devices: Sequence[Sequence[int]], where: str = "Plan") -> ChunkLayout:
    """The :class:`ChunkLayout` of stages with ``devices`` (per stage, its device ids).

    Raises:
        ValueError: naming the stage (its chunk) and the device: a device listed twice in one stage, or in two
            stages whose device lists differ (chunks of one group list the same devices in the same order); groups
            of different chunk counts; chunks in neither the loop nor the V order.
    """
    groups: list[tuple[int, ...]] = []
    owner: dict[int, tuple[int, int]] = {}  # device -> (its group, the first stage listing it)
    group_of = []
    for s, ds in enumerate(devices):
        ds = tuple(ds)
        if len(set(ds)) != len(ds):
            d = next(d for d in ds if ds.count(d) > 1)
            raise ValueError(f"{where}.stages[{s}].devices: device {d} is listed twice in stage {s}: {list(ds)}")
        g = next((owner[d][0] for d in ds if d in owner), None)
        if g is None:
            g = len(groups)
            groups.append(ds)
            owner.update((d, (g, s)) for d in ds)
        elif ds != groups[g]:
            d = next(d for d in ds if d in owner)
            first = owner[d][1]
            raise ValueError(f"{where}.stages[{s}].devices: device {d} is already in stage {first} (devices "
                             f"{list(groups[g])}); stages on one device group (its chunks) list the same devices "
                             f"in the same order, got {list(ds)}")
        group_of.append(g)
    counts = [group_of.count(g) for g in range(len(groups))]
    if len(set(counts)) > 1:
        g = next(g for g in range(len(groups)) if counts[g] != counts[0])
        raise ValueError(f"{where}: device group {list(groups[g])} holds {counts[g]} chunk(s) (stages "
                         f"{[s for s, x in enumerate(group_of) if x == g]}) but device group {list(groups[0])} holds "
                         f"{counts[0]} (stages {[s for s, x in enumerate(group_of) if x == 0]}); every device group "
                         f"holds the same number of chunks")
    chunks = counts[0] if counts else 1
    if chunks == 1:
        return ChunkLayout(tuple(groups), tuple(group_of), ())
    orders = {pl: group_order(len(groups), chunks, pl) for pl in PLACEMENTS if pl == "loop" or chunks == 2}
    found = tuple(pl for pl, order in orders.items() if order == group_of)
    if not found:
        raise ValueError(_order_error(where, groups, group_of, orders))
    return ChunkLayout(tuple(groups), tuple(group_of), found)


def _order_error(where: str, groups: list[tuple[int, ...]], group_of: list[int], orders: dict[str, list[int]]) -> str:
    """The message for stages in neither order: the first stage off each order, where that order wants it."""
    p, v = len(groups), len(group_of) // len(groups)
    s = max(next(i for i, (a, b) in enumerate(zip(group_of, order)) if a != b) for order in orders.values())
    want = " or ".join(dict.fromkeys(f"devices {list(groups[order[s]])}" + (f" ({pl})" if len(
        {o[s] for o in orders.values()}) > 1 else "") for pl, order in orders.items()))
    return (f"{where}.stages[{s}] (devices {list(groups[group_of[s]])}, chunk "
            f"{group_of[:s].count(group_of[s])} of its device group) breaks the chunk orders: with {p} device groups "
            f"of {v} chunks, stage {s} belongs on {want}; stages in pipeline order visit the groups 0..{p - 1} "
            f"{'then again (loop)' if 'V' not in orders else 'then again (loop), or then back (V)'}")
