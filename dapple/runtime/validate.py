"""Checks of a plan against the world, the model and each batch, run before any work; errors name values."""

from __future__ import annotations

import zlib
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..core.dist import bounded, wait_for
from ..core.plan import Plan
from ..core.schedule import validate_warmup
from ..profiler.layers import Arity


def check_plan(plan: Any, world_size: int) -> None:
    """The plan is a valid Plan for a world of ``world_size`` ranks, every rank in exactly one stage."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a dapple.Plan (e.g. dapple.Plan.load('plan.yaml')), got "
                        f"{type(plan).__name__}")
    plan.validate()  # contiguous layer ranges from 0, device ids 0..n-1 each in one stage, batch divisibility
    if plan.num_devices != world_size:
        raise ValueError(f"plan needs {plan.num_devices} ranks, world has {world_size} (launch with "
                         f"torchrun --nproc_per_node={plan.num_devices}, or make a plan for {world_size} devices)")
    validate_warmup(plan.warmup, plan.num_micro_batches)


def layout_mismatch(plan: Plan, local_world_size: int | None) -> str | None:
    """Why the plan's placement will not hold on this job, or None: it was made for servers of
    ``devices_per_server`` devices (``meta["cluster_spec"]``, which dapple.plan records) and this job runs
    ``local_world_size`` ranks per node (torchrun's LOCAL_WORLD_SIZE; None: not known). Ranks then map to other
    servers than planned: the run stays correct, but the stages' transfers and AllReduces cross other links."""
    spec = plan.meta.get("cluster_spec")
    if not isinstance(spec, dict) or local_world_size is None:
        return None
    per = spec.get("devices_per_server")
    if not isinstance(per, int) or per == local_world_size or plan.num_devices <= min(per, local_world_size):
        return None  # (every rank on one server either way)
    return (f"plan was made for servers of {per} devices ({spec.get('servers')} x {per}, meta.cluster_spec) but "
            f"this job runs {local_world_size} ranks per node (LOCAL_WORLD_SIZE): its stages sit on other servers "
            f"than planned and its estimate does not hold; plan for devices_per_server={local_world_size}")


def as_tuple(x: Any, what: str) -> tuple[torch.Tensor, ...]:
    """A tensor or a tuple/list of tensors, as a tuple."""
    xs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    for i, t in enumerate(xs):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}[{i}]: expected a tensor, got {type(t).__name__}")
    return xs


def check_batch(plan: Plan, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], arity: Arity,
                any_rows: bool = False) -> None:
    """Inputs match the model's arguments (``arity``) and every input/target holds the global batch in
    dimension 0 (``any_rows``: the same batch of any positive multiple of the micro-batch size)."""
    arity.check(len(inputs), "inputs")
    g, b = plan.global_batch_size, plan.micro_batch_size
    if any_rows and inputs and inputs[0].dim() > 0 and inputs[0].shape[0] > 0 and inputs[0].shape[0] % b == 0:
        g = inputs[0].shape[0]
    for what, xs in (("inputs", inputs), ("targets", targets)):
        for i, t in enumerate(xs):
            if t.dim() == 0 or t.shape[0] != g:
                expected = (f"a batch of a multiple of plan.micro_batch_size ({b}) rows in dimension 0, the same "
                            f"for every input and target" if any_rows else
                            f"the global batch of {g} rows (plan.global_batch_size) in dimension 0, split into "
                            f"{plan.num_micro_batches} micro-batches of {b}")
                raise ValueError(f"{what}[{i}] has shape {tuple(t.shape)}; expected {expected}")


def batch_sums(xs: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Two float64 checksums of a batch: the sum of its row sums and their sum weighted by row and tensor index.
    Cheap (one pass, nothing batch-sized allocated) and, for batches of the same shapes, different almost surely
    when any row differs: a rank that passes its own shard instead of the global batch is caught."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for k, x in enumerate(xs):
        x = x.detach()
        rows = (x.reshape(x.shape[0], -1).sum(1, dtype=torch.float64) if x.dim() else x.reshape(1).double())
        rows = torch.nan_to_num(rows.to(device), nan=0.0, posinf=1e300, neginf=-1e300)
        weight = torch.arange(1, rows.numel() + 1, dtype=torch.float64, device=device)
        total += torch.stack([rows.sum(), (rows * weight).sum() / rows.numel()]) * (k + 1)
    return total


def check_same_inputs(inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], key: Any,
                      device: torch.device, timeout: float, where: str, values: bool = True) -> None:
    """Every rank was given the same global batch, as it must be: inputs of the same shapes and dtypes (``key``;
    the receivers allocate each activation from their own inputs' shapes, and a sender whose shapes differ would
    fill their buffers only in part) and, with ``values``, the same inputs and targets (:func:`batch_sums`).

    One MAX AllReduce of the fingerprints and their negations (max == -min: all agree); where ranks differ, every
    rank learns it at once and raises a ValueError naming each rank's shapes or which ranks' data differ.
    """
    fp = float(zlib.crc32(repr(key).encode()))  # < 2**32: exact in float64
    sums = (torch.cat([batch_sums(inputs, device), batch_sums(targets, device)]) if values
            else torch.zeros(4, dtype=torch.float64, device=device))
    mine = torch.cat([torch.tensor([fp], dtype=torch.float64, device=device), sums])
    both = torch.cat([mine, -mine])
    wait_for(dist.all_reduce(both, op=dist.ReduceOp.MAX, async_op=True), timeout,
             f"{where}: checking that every rank has the same inputs and targets")
    most, least = both.tolist()[:5], both.tolist()[5:]  # one copy to the host
    if all(m == -n for m, n in zip(most, least)):
        return
    keys: list[Any] = [None] * dist.get_world_size()
    bounded(timeout, f"{where}: gathering every rank's inputs' shapes and checksums", dist.all_gather_object, keys,
            (key, mine.tolist()))
    if most[0] != -least[0]:
        shown = "; ".join(f"rank {r}: {[(list(shape), str(dtype)) for shape, dtype in k]}"
                          for r, (k, _) in enumerate(keys))
        raise ValueError(f"{where}: the ranks were given inputs of different shapes or dtypes (every rank must get "
                         f"the same global batch); per input, (shape after the batch dimension, dtype): {shown}")
    which = "inputs" if most[1:3] != [-v for v in least[1:3]] else "targets"
    groups: dict[tuple, list[int]] = {}
    for r, (_, sums_r) in enumerate(keys):
        groups.setdefault(tuple(sums_r[1:3] if which == "inputs" else sums_r[3:5]), []).append(r)
    raise ValueError(f"{where}: the ranks were given different {which} of the same shapes: every rank must pass "
                     f"the same global batch (not its own shard, as with DDP); ranks with equal {which}: "
                     f"{sorted(groups.values())}. Pass check_inputs=False to dapple.pipeline to skip this check")
