"""Gradient buckets: the size and the rule the runtime reduces by and the cost model prices (DDP's)."""

from __future__ import annotations

from typing import Callable, Sequence

BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb=25: one AllReduce per bucket of about this size


def bucket(sizes: Sequence[float], limit: float = BUCKET_BYTES,
           joins: Callable[[int, int], bool] | None = None) -> list[list[int]]:
    """Group items into buckets, in the order given (the order backward finishes them).

    Args:
        sizes: bytes of each item (a parameter, or a layer's parameters).
        limit: a bucket holds at most this many bytes, unless one item alone is larger.
        joins: ``joins(i, j)``: whether item ``j`` may share a bucket whose first item is ``i`` (e.g. same dtype
            and device); None: any may.

    Returns:
        The indices of each bucket's items; consecutive items share a bucket while they fit.
    """
    out: list[list[int]] = []
    size = 0.0
    for i, nbytes in enumerate(sizes):
        if out and size + nbytes <= limit and (joins is None or joins(out[-1][0], i)):
            out[-1].append(i)
            size += nbytes
        else:
            out.append([i])
            size = nbytes
    return out
