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


def check_same_inputs(key: Any, device: torch.device, timeout: float, where: str) -> None:
    """Every rank was given inputs of the same shapes and dtypes (``key``), as the global batch must be: the
    receivers allocate each activation from their own inputs' shapes, and a sender whose shapes differ would
    fill their buffers only in part. One MAX AllReduce of a fingerprint and its negation (max == -min: all
    agree); where ranks differ, every rank learns it at once and raises a ValueError naming each rank's."""
    fp = float(zlib.crc32(repr(key).encode()))  # < 2**32: exact in float64
    both = torch.tensor([fp, -fp], dtype=torch.float64, device=device)
    wait_for(dist.all_reduce(both, op=dist.ReduceOp.MAX, async_op=True), timeout,
             f"{where}: checking that every rank has inputs of the same shapes")
    most, least = both.tolist()  # one copy to the host
    if most == -least:
        return
    keys: list[Any] = [None] * dist.get_world_size()
    bounded(timeout, f"{where}: gathering every rank's input shapes", dist.all_gather_object, keys, key)
    shown = "; ".join(f"rank {r}: {[(list(shape), str(dtype)) for shape, dtype in k]}" for r, k in enumerate(keys))
    raise ValueError(f"{where}: the ranks were given inputs of different shapes or dtypes (every rank must get the "
                     f"same global batch); per input, (shape after the batch dimension, dtype): {shown}")
