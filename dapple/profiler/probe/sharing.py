"""Link-sharing probe: do two sends posted at once from one device share its link, or go one after the other?"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
import torch.distributed as dist

from ...core.checks import is_int
from ...core.dist import barrier, timeout_seconds, wait_for
from .clocks import sync_clock
from .device import probe_device, synchronize

SHARING_BYTES = 1 << 24  # 16 MiB per send: milliseconds even on NVLink, far above clock-sync errors
HELD_BELOW = 0.75  # first / last arrival: held gives 0.5, shared 1.0
INDEPENDENT_BELOW = 1.4  # last arrival / a send alone: 2.0 when the two sends share the sender's link


def verdict(solo: float, first: float, last: float) -> str:
    """``"held"``, ``"shared"`` or ``"independent"`` from the median seconds of a send alone and of the first
    and last of two sends posted at once.

    The planner's cost model and simulator follow ``Cluster.link_sharing``: ``"held"`` (a transfer holds its
    links whole; concurrent ones go one after the other) or ``"shared"`` (they share each link max-min fairly).
    The two differ in when the first of two concurrent transfers lands: held, after one transfer's time; shared,
    with the second, after two. So ``first / last`` below ``HELD_BELOW`` means held, else shared, unless
    ``last / solo`` is below ``INDEPENDENT_BELOW``: the two sends did not slow each other (the sender's link is
    not what limits them), which neither discipline describes.
    """
    for name, v in (("solo", solo), ("first", first), ("last", last)):
        if not v > 0:
            raise ValueError(f"link-sharing probe: {name} arrival must be a positive time, got {v!r} s")
    if last < INDEPENDENT_BELOW * solo:
        return "independent"
    return "held" if first < HELD_BELOW * last else "shared"


def concurrent_sends(receivers: Sequence[int], nbytes: int = SHARING_BYTES, repeats: int = 5,
                     timeout: float = 120.0) -> dict:
    """Rank 0 sends ``nbytes`` to ``receivers[0]`` alone, then to both ``receivers`` at once, ``repeats`` times
    each (after one untimed round), as the runtime posts a split's sends; every rank of the default group calls
    it. Arrivals are compared on rank 0's clock (receivers' clocks corrected by :func:`.clocks.sync_clock`).

    Args:
        receivers: two distinct ranks other than 0.
        nbytes: bytes per send.
        repeats: timed rounds of each kind.
        timeout: seconds every wait is bounded by.

    Returns:
        The same dict on every rank: ``{"receivers", "bytes", "solo_s", "first_s", "last_s", "verdict"}``
        (medians, seconds from the send; ``verdict`` by :func:`verdict`).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = timeout_seconds("timeout", timeout)
    for name, v in (("nbytes", nbytes), ("repeats", repeats)):
        if not is_int(v, 1):
            raise ValueError(f"link-sharing probe: {name}: expected a positive integer, got {v!r}")
    if len(receivers) != 2 or len(set(receivers)) != 2 or not all(0 < r < world for r in receivers):
        raise ValueError(f"link-sharing probe: expected two distinct receiver ranks in 1..{world - 1}, "
                         f"got {list(receivers)}")
    device = probe_device()
    offset = sync_clock(time.perf_counter, rank, world, device, timeout).offset  # rank 0's clock = this one's + offset
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)  # (nbytes / 4,)
    rounds: dict[str, list[list[float]]] = {"solo": [], "pair": []}
    for i in range(repeats + 1):
        for mode, targets in (("solo", receivers[:1]), ("pair", receivers)):
            arrivals = _round(buf, nbytes, targets, offset, timeout, f"link-sharing probe, rank {rank}: round {i} "
                              f"({mode})")
            if i:  # the first round sets up the connections
                rounds[mode].append(arrivals)
    solo = statistics.median(r[0] for r in rounds["solo"])
    first = statistics.median(min(r) for r in rounds["pair"])
    last = statistics.median(max(r) for r in rounds["pair"])
    return {"receivers": list(receivers), "bytes": int(buf.numel() * 4), "solo_s": solo, "first_s": first,
            "last_s": last, "verdict": verdict(max(solo, 1e-9), max(first, 1e-9), max(last, 1e-9))}


def _round(buf: torch.Tensor, nbytes: int, targets: Sequence[int], offset: float, timeout: float, where: str
           ) -> list[float]:
    """Rank 0 sends ``buf`` (``nbytes``) to every rank of ``targets`` at once (every rank calls it); seconds from the
    start of the sends to each target's arrival, on rank 0's clock (``offset``: rank 0's clock minus this rank's)."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), buf.device
    stamp = torch.zeros(1, dtype=torch.float64, device=device)  # (1,) this rank's time, on rank 0's clock
    works = [dist.irecv(buf, src=0)] if rank in targets else []
    barrier(device, timeout, f"{where}: the barrier before the sends")
    synchronize(device)
    t0 = time.perf_counter()
    if rank == 0:
        works = [dist.isend(buf, dst=r) for r in targets]
    for w in works:
        wait_for(w, timeout, f"{where}: a {nbytes}-byte transfer between rank 0 and ranks {list(targets)}")
    synchronize(device)
    stamp.fill_((time.perf_counter() + offset) if rank in targets else t0)
    stamps = [torch.zeros_like(stamp) for _ in range(world)]  # (world,) rank 0's start, the receivers' arrivals
    wait_for(dist.all_gather(stamps, stamp, async_op=True), timeout, f"{where}: gathering the times")
    return [float(stamps[r].item()) - float(stamps[0].item()) for r in targets]
