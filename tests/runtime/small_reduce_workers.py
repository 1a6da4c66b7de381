"""Rank functions for tests/runtime/test_small_reduce.py (importable by spawned processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dapple.runtime.small_reduce import reduce_small

from ._spawn import reported, stall_until_reported


def reduce_all(width: int) -> dict:
    """Every rank reduces its own seeded vector (sum and max) over all ranks and over the ranks 1.. (a group);
    returns what it got and what dist.all_reduce gives (as lists: float64 values, exact)."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.randn(width, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + rank)) * 10 ** rank
    out: dict = {"mine": mine.clone()}
    for op in ("sum", "max"):
        got = mine.clone()
        reduce_small(got, op, 30.0, f"rank {rank}", f"test {op}", range(world))
        out[op] = got
        ref = mine.clone()
        dist.all_reduce(ref, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        out[f"torch {op}"] = ref
    rest = list(range(1, world))
    group = dist.new_group(rest)
    if rank in rest:
        got = mine.clone()
        reduce_small(got, "sum", 30.0, f"rank {rank}", "test group", rest, group)
        out["group sum"] = got
    dist.barrier()  # rank 0 (the store's host) stays until the group is done
    return {k: v.tolist() for k, v in out.items()}


def reduce_without(absent: int) -> str | None:
    """Rank ``absent`` stays away; the others' reduction times out. Returns each waiting rank's error."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == absent:
        stall_until_reported("small_reduce_done", world - 1)
        return None
    try:
        reduce_small(torch.ones(3, dtype=torch.float64), "sum", 2.0, f"rank {rank}", "step 7: loss AllReduce",
                     range(world))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        reported("small_reduce_done")
    return "no error"
