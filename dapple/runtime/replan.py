"""``Pipeline.replan``: the running job moved to another plan between steps, in memory: every rank's parameters,
buffers, gradients and optimizer state sent to their owners under the new plan (what a checkpoint saved under one
plan and loaded under another moves, without the disk)."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..core.dist import PipelineError, first_line
from ..core.plan import Plan
from .distributed import DistContext
from .replan_optimizer import check_groups, check_optimizer, hypers, rebuild_optimizer
from .reshard import PARAMETER, Held, exchanges, holdings, sources, stage_state
from .roll import called, gloo_world_group, waited


class Replannable(Protocol):
    """What a replan reads of a pipeline (:class:`dapple.Pipeline`)."""

    ctx: DistContext
    plan: Plan
    stage: int
    replica: int
    global_step: int
    timeout: float
    who: str  # "rank 3 (stage 1)", for messages
    training: bool
    module: nn.Module
    state_names: dict[int, list[str]]
    scaler: Any

    def named_parameters(self) -> Any:
        ...

    def train(self, mode: bool = True) -> Any:
        ...


@dataclass(frozen=True)
class Switch:
    """What one rank's switch of plan did, and its cost (seconds on this rank; bytes of tensor data)."""

    seconds: float  # all of it
    build_seconds: float  # the new plan's stage: tracing and splitting the model, its process groups
    move_seconds: float  # describing, sending and receiving the state
    sent_bytes: int
    received_bytes: int
    kept: int  # keys (parameters, buffers) this rank held already
    received: int  # keys it received
    old_plan: str  # the plans' shapes ("0-4x2 4-9x2 M8")
    new_plan: str


def rebuild_args(args: dict[str, Any]) -> dict[str, Any]:
    """What :meth:`Pipeline.replan` builds the next plan's pipeline from: ``args`` (the model, loss and options the
    pipeline was made with) with the model replaced by its skeleton (:func:`skeleton`, or the reason there is none,
    a string) and ``init_fn`` by :func:`zero_init` (every value of the new stage is received)."""
    try:
        model: Any = skeleton(args["model"])
    except Exception as e:  # a model deepcopy refuses: replan says why
        model = f"its model cannot be copied ({type(e).__name__}: {first_line(e)})"
    return {**args, "model": model, "init_fn": zero_init}


def skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers lie on the meta device: its structure, no data (tied
    tensors stay tied)."""
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def zero_init(module: nn.Module) -> None:
    """Fill a materialised module's own tensors with zeros (a replan then copies every value in)."""
    for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        t.zero_()


def check_replan(pipe: Replannable, plan: Any, optimizer: Any, rebuild: dict[str, Any]) -> None:
    """TypeError/ValueError naming the argument, before anything is built or sent (every rank finds the same)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"replan: expected a dapple.Plan, got {type(plan).__name__}")
    if plan.num_devices != pipe.ctx.world_size:
        raise ValueError(f"replan: the new plan uses {plan.num_devices} devices, the job runs {pipe.ctx.world_size} "
                         f"ranks (a replan keeps the processes; change the world size with a checkpoint instead)")
    if plan.global_batch_size != pipe.plan.global_batch_size:
        raise ValueError(f"replan: the new plan's global batch is {plan.global_batch_size}, the running one's "
                         f"{pipe.plan.global_batch_size} (a replan changes where the work runs, not what it is)")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"replan: optimizer: expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    if isinstance(rebuild["model"], str):
        raise ValueError(f"replan: {rebuild['model']}; save a checkpoint and load it under the new plan instead")


class StateMove:
    """A switch in two collective halves: :meth:`__init__` on the running pipeline (what every rank holds; errors
    agreed before anything is built), :meth:`into` once the new plan's pipeline is built (what every rank needs,
    the transfers, the copies into the new stage, the optimizer)."""

    def __init__(self, pipe: Replannable, optimizer: torch.optim.Optimizer | None, started: float):
        self.pipe, self.optimizer, self.started = pipe, optimizer, started
        self.who = pipe.who
        self.group = _group(pipe, self.who)
        self.state = stage_state(pipe.module, pipe.state_names, {id(p): n for n, p in pipe.named_parameters()})
        error, mine = None, None
        try:
            check_optimizer(optimizer, self.state)
            mine = (holdings(self.state, optimizer, pipe.ctx.device, pipe.replica == 0), hypers(optimizer))
        except (TypeError, ValueError) as e:
            error = e
        every = self._gather(mine, error, "replan: describing what each rank holds")
        check_groups([g for _, g in every])  # the same on every rank: all raise alike
        self.held: list[dict[str, Held]] = [h for h, _ in every]
        self.described = time.perf_counter()

    def into(self, new: Replannable) -> Switch:
        """Send and receive every key ``new``'s stage holds, copy it in, rebuild the optimizer (collective)."""
        built = time.perf_counter()
        rank = new.ctx.rank
        target = stage_state(new.module, new.state_names, {id(p): n for n, p in new.named_parameters()})
        wants = self._gather(sorted(target), None, "replan: telling what each rank needs")
        src_of = sources(self.held, wants)
        got, sent, received = self._transfer(exchanges(src_of), new.ctx.device)
        values = {key: got[key] if key in got else self._local(key) for key in target}
        with torch.no_grad():
            for key, (kind, t) in target.items():
                value, grad, _ = values[key]
                if value is not t:
                    t.copy_(value)
                if kind == PARAMETER and t.grad is not grad:
                    t.grad = grad
        if self.optimizer is not None:
            rebuild_optimizer(self.optimizer, target, {k: self.held[src_of[(rank, k)]][k] for k in target}, values)
        new.global_step = self.pipe.global_step
        new.scaler.load_state_dict(self.pipe.scaler.state_dict())
        new.scaler.found_inf = self.pipe.scaler.found_inf
        new.train(self.pipe.training)
        done = time.perf_counter()
        kept = sum(1 for key in target if src_of[(rank, key)] == rank)
        return Switch(done - self.started, built - self.described, (self.described - self.started) + (done - built),
                      sent, received, kept, len(target) - kept, _shape(self.pipe.plan), _shape(new.plan))

    # ---- pieces ------------------------------------------------------------------------------------
    def _local(self, key: str) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """(value, gradient, optimizer state tensors in :class:`Held` order) of a key this rank holds."""
        kind, t = self.state[key]
        if kind != PARAMETER:
            return t, None, []
        st = self.optimizer.state.get(t, {}) if self.optimizer is not None else {}
        return t, t.grad, [st[k] for k, _ in self.held[self.pipe.ctx.rank][key].state]

    def _transfer(self, pairs: dict[tuple[int, int], list[str]], device: torch.device
                  ) -> tuple[dict[str, tuple], int, int]:
        """Post every send and receive of this rank at once and wait for them all (bounded): the received keys as
        (value, gradient, optimizer state tensors), and the bytes sent and received."""
        rank = self.pipe.ctx.rank
        ops: list[dist.P2POp] = []
        got: dict[str, tuple] = {}
        sent = received = 0
        for (src, dst), keys in pairs.items():  # every rank walks the pairs and keys in one order
            for key in keys:
                h = self.held[src][key]
                if src == rank:
                    value, grad, state = self._local(key)
                    if h.grad is not None and grad is None:
                        raise RuntimeError(f"replan: rank {rank} described a gradient of {key!r} it no longer holds")
                    for t in [value, *([grad] if grad is not None and h.grad is not None else []), *state]:
                        t = t.detach().contiguous()
                        ops.append(dist.P2POp(dist.isend, t, dst, self._group_for(t)))
                        sent += t.numel() * t.element_size()
                elif dst == rank:
                    bufs = [p.empty(device) for p in h.pieces()]
                    ops += [dist.P2POp(dist.irecv, b, src, self._group_for(b)) for b in bufs]
                    received += sum(b.numel() * b.element_size() for b in bufs)
                    n = 2 if h.grad is not None else 1
                    got[key] = (bufs[0], bufs[1] if h.grad is not None else None, bufs[n:])
        peers = sorted({p for pair in pairs if rank in pair for p in pair} - {rank})
        place = f"replan: moving state to and from ranks {peers}"
        works = []
        for group in (self.group, None):  # one batch per group (torch's rule), in one order on every rank
            batch = [op for op in ops if op.group is group]
            try:
                works += dist.batch_isend_irecv(batch) if batch else []
            except Exception as e:
                raise PipelineError(f"{self.who}: {place}: posting the transfers failed: {first_line(e)}") from e
        for w in works:
            waited(w, self.pipe.timeout, self.who, place, [rank, *peers], device)
        return got, sent, received

    def _group_for(self, t: torch.Tensor) -> dist.ProcessGroup | None:
        """A device tensor on the default group (NCCL on GPUs), a CPU one on the gloo group."""
        return self.group if t.device.type == "cpu" else None

    def _gather(self, payload: Any, error: BaseException | None, place: str) -> list[Any]:
        """Every rank's ``payload``; if any rank failed, every rank raises (its own error, or naming the rank)."""
        pipe = self.pipe
        out: list[Any] = [None] * pipe.ctx.world_size
        msg = None if error is None else f"{type(error).__name__}: {first_line(error)}"
        called(pipe.timeout, self.who, place, range(pipe.ctx.world_size), dist.all_gather_object, out,
               (None if error else payload, msg), group=self.group)
        if error is not None:
            raise error
        failed = [(r, m) for r, (_, m) in enumerate(out) if m is not None]
        if failed:
            raise PipelineError(f"{self.who}: {place}: rank {failed[0][0]} ("
                                f"{pipe.plan.device_label(failed[0][0])}) cannot: {failed[0][1]}")
        return [p for p, _ in out]


def _group(pipe: Replannable, who: str) -> dist.ProcessGroup:
    """A gloo group of every rank with the pipeline's timeout, for the exchange's objects and CPU tensors (made by
    the first replan of ``pipe``: every rank calls it)."""
    return gloo_world_group(pipe, "replan", who, "replan: creating the gloo group of every rank (did every rank call "
                            "replan?)")


def _shape(plan: Plan) -> str:
    """``0-4x2 4-9x2 M8 dapple``: layer ranges x replicas, micro-batches, schedule."""
    return (" ".join(f"{s.layers[0]}-{s.layers[1]}x{s.replicas}" for s in plan.stages)
            + f" M{plan.num_micro_batches} {plan.schedule}")


def close_groups(groups: list[Any]) -> None:
    """Destroy the process groups a replaced pipeline made (this rank's handles; a group it is not in is none)."""
    for g in groups:
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)

