"""Clock offsets of every rank to rank 0 (ping-pong, Cristian's method), and gathering JSON payloads to rank 0."""

from __future__ import annotations

import json
from bisect import bisect_right
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from ...core.dist import barrier, wait_for

PINGS = 16  # round trips per rank; the offset lies in the intersection of their intervals
TAG = 31_415  # message tag for the pings (gloo matches by tag, keeping them apart from pipeline transfers)


class ClockSync:
    """One offset estimate: at this rank's clock ``local``, rank 0's clock read ``local + offset`` (seconds),
    within ``error`` (half the shortest round trip; 0 for rank 0 itself)."""

    __slots__ = ("local", "offset", "error")

    def __init__(self, local: float, offset: float, error: float):
        self.local, self.offset, self.error = local, offset, error

    def to_list(self) -> list[float]:
        return [self.local, self.offset, self.error]

    def __repr__(self) -> str:
        return f"ClockSync(local={self.local:.6f}, offset={self.offset * 1e3:+.3f} ms, error={self.error * 1e6:.0f} us)"


class _Ctx(NamedTuple):
    rank: int
    world: int
    device: torch.device
    timeout: float


def _wait(work: Any, ctx: _Ctx, what: str) -> None:
    wait_for(work, ctx.timeout, f"rank {ctx.rank}: {what}", ctx.device)


def sync_clock(clock: Callable[[], float], rank: int, world: int, device: torch.device, timeout: float,
               pings: int = PINGS) -> ClockSync:
    """This rank's offset to rank 0's ``clock`` (collective over the default group: call on every rank).

    For each rank r > 0 in turn, r stamps a = its clock and sends a ping; rank 0 replies with T, its clock on
    receipt; r stamps b on the reply. Rank 0 read its clock between a and b, so the offset (rank 0's clock minus
    r's) lies in [T - b, T - a] whatever the delays in each direction. The offset lies in every round trip's
    interval, so their intersection is kept: the estimate is its middle, the error bound its half-width.
    Clocks drift, so a trace syncs when recording starts and again when it is saved (see :func:`correction`).

    Args:
        clock: this rank's clock (seconds).
        rank, world: this rank and the world size of the default group.
        device: where the timestamps travel (the default group's device).
        timeout: seconds every wait is bounded by.
        pings: round trips per rank.
    """
    if pings < 1:
        raise ValueError(f"pings: expected at least one round trip, got {pings!r}")
    ctx = _Ctx(rank, world, device, timeout)
    if world == 1:
        return ClockSync(clock(), 0.0, 0.0)
    buf = torch.zeros(1, dtype=torch.float64, device=device)  # (1,) a timestamp in seconds
    lo, hi, mid = -float("inf"), float("inf"), 0.0  # the offset lies in [lo, hi]; mid: this clock then
    for r in range(1, world):  # one rank at a time, so rank 0 answers without queueing
        if rank == 0:
            for _ in range(pings):
                _wait(dist.irecv(buf, src=r, tag=TAG), ctx, f"clock sync: ping from rank {r}")
                buf.fill_(clock())
                _wait(dist.isend(buf, dst=r, tag=TAG), ctx, f"clock sync: reply to rank {r}")
        elif rank == r:
            for _ in range(pings):
                a = clock()
                _wait(dist.isend(buf, dst=0, tag=TAG), ctx, "clock sync: ping to rank 0")
                _wait(dist.irecv(buf, src=0, tag=TAG), ctx, "clock sync: reply from rank 0")
                b = clock()
                t = float(buf.item())
                if t - b > lo:
                    lo = t - b
                if t - a < hi:
                    hi, mid = t - a, (a + b) / 2
    # leave together, as ranks leave a step (its loss AllReduce): a traced step then starts as an untraced one
    barrier(device, timeout, f"rank {rank}: clock sync: closing barrier")
    if rank == 0:
        return ClockSync(clock(), 0.0, 0.0)
    if lo > hi:  # impossible for clocks that do not jump: trust the tightest side, report the contradiction
        return ClockSync(mid, (lo + hi) / 2, (lo - hi) / 2)
    return ClockSync(mid, (lo + hi) / 2, (hi - lo) / 2)


def constant_offset(syncs: Sequence[Sequence[float]]) -> tuple[float, float] | None:
    """(offset, error) of one offset within every sync's [offset - error, offset + error], or None if no
    constant offset fits them all (the clocks drifted measurably between the syncs)."""
    if not syncs:
        return None
    lo = max(float(s[1]) - float(s[2]) for s in syncs)
    hi = min(float(s[1]) + float(s[2]) for s in syncs)
    return ((lo + hi) / 2, (hi - lo) / 2) if lo <= hi else None


def correction(syncs: Sequence[Sequence[float]]) -> Callable[[float], float]:
    """Local time -> rank 0's time. ``syncs``: (local, offset, error) triples. One constant offset if one fits
    every sync (:func:`constant_offset`), else the offset interpolated linearly between the sync points
    (drift), constant before the first and after the last."""
    if not syncs:
        return lambda t: t
    const = constant_offset(syncs)
    if const is not None:
        off = const[0]
        return lambda t: t + off
    pts = sorted((float(s[0]), float(s[1])) for s in syncs)
    xs = [p[0] for p in pts]

    def to_rank0(t: float) -> float:
        i = min(max(bisect_right(xs, t), 1), len(pts) - 1)
        (x0, o0), (x1, o1) = pts[i - 1], pts[i]
        w = min(max((t - x0) / (x1 - x0), 0.0), 1.0) if x1 > x0 else 1.0
        return t + o0 + (o1 - o0) * w
    return to_rank0


def gather_json(obj: Any, rank: int, world: int, device: torch.device, timeout: float) -> list[Any] | None:
    """``obj`` (JSON-able) from every rank, as a list on rank 0 (None elsewhere); bounded by ``timeout``."""
    ctx = _Ctx(rank, world, device, timeout)
    data = json.dumps(obj).encode()
    if world == 1:
        return [json.loads(data)]
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    _wait(dist.all_gather(sizes, n, async_op=True), ctx, "gathering trace sizes")
    longest = int(max(int(s.item()) for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8)  # (bytes,) this rank's JSON, zero-padded
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    bufs = [torch.empty_like(buf) for _ in range(world)] if rank == 0 else None
    _wait(dist.gather(buf, bufs, dst=0, async_op=True), ctx, "gathering traces to rank 0")
    if bufs is None:
        return None
    return [json.loads(bytes(b[:int(s.item())].cpu().numpy())) for b, s in zip(bufs, sizes)]
