"""Step timing shared by the multi-process benchmarks: all ranks start together, the slowest one ends a step."""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist


def timed_steps(step: Callable[[], object], steps: int, cpu_clock: Callable[[], float] = time.process_time,
                cpu: str = "sum", before: Callable[[], object] | None = None) -> list[tuple[float, float]]:
    """Run ``step`` ``steps`` times on every rank; per step (wall ms until the slowest rank is done, CPU ms of
    ``cpu_clock`` over the ranks: their ``"sum"`` or ``"mean"``). A barrier lines the ranks up before each;
    ``before`` (e.g. dropping gradients, as ``optimizer.zero_grad()`` does) runs ahead of it, untimed."""
    if cpu not in ("sum", "mean"):
        raise ValueError(f"cpu: expected 'sum' or 'mean', got {cpu!r}")
    out = []
    for _ in range(steps):
        if before is not None:
            before()
        dist.barrier()
        t0, c0 = time.perf_counter(), cpu_clock()
        step()
        wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        used = torch.tensor([cpu_clock() - c0], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        dist.all_reduce(used)
        scale = 1.0 / dist.get_world_size() if cpu == "mean" else 1.0
        out.append((1e3 * float(wall), 1e3 * float(used) * scale))
    return out
