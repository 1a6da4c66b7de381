"""Split-concat routing (paper V-B2): which rows of a micro-batch each replica holds and sends where."""

from __future__ import annotations

from typing import NamedTuple


class Route(NamedTuple):
    """Rows ``[start, end)`` of a micro-batch go from sender replica ``src`` to receiver replica ``dst``."""

    src: int
    dst: int
    start: int
    end: int

    @property
    def rows(self) -> int:
        return self.end - self.start


def slice_bounds(rows: int, replicas: int) -> list[tuple[int, int]]:
    """Nearly even row slices of a micro-batch, as ``torch.tensor_split``: the first rows % r get one more."""
    if replicas < 1 or rows < replicas:
        raise ValueError(f"cannot split {rows} rows over {replicas} replicas (each needs at least one row)")
    q, extra = divmod(rows, replicas)
    bounds, start = [], 0
    for i in range(replicas):
        end = start + q + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def routes(rows: int, senders: int, receivers: int) -> list[Route]:
    """Every (sender, receiver) pair whose slices overlap, with the overlapping rows, in a fixed order.

    1 -> n is a split, n -> 1 a concat, n -> m both; equal counts give one route per replica pair.
    The order (by sender, then receiver) is the order in which both sides post their transfers.
    """
    src, dst = slice_bounds(rows, senders), slice_bounds(rows, receivers)
    out = []
    first = 0  # the first receiver that can still overlap the current sender (both are sorted by rows)
    for i, (a0, a1) in enumerate(src):
        while first < len(dst) and dst[first][1] <= a0:
            first += 1
        for j in range(first, len(dst)):
            b0, b1 = dst[j]
            if b0 >= a1:
                break
            out.append(Route(i, j, max(a0, b0), min(a1, b1)))
    return out
