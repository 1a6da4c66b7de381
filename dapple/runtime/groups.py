"""Gradient AllReduce groups (per replicated stage, per set of stages sharing tied parameters), in buckets (V-B3)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..core.buckets import BUCKET_BYTES, bucket
from ..core.dist import bounded, group_timeout
from ..core.plan import Plan
from .roll import waited
from .stages import StageGraph


@dataclass
class GradGroup:
    """Ranks that sum gradients of ``names`` (canonical parameter names) after the last backward."""

    label: str  # "stage 1 replicas" or "tied stages 0,3"
    ranks: list[int]
    names: list[str]
    group: dist.ProcessGroup | None = None  # set on members only
    params: list[nn.Parameter] = field(default_factory=list)  # this rank's tensors for ``names``
    spans_stages: bool = False  # tied parameters of several stages: summed after the backward, never during it
    root: int = 0  # the rank whose copies every member starts from (a stage's first replica)
    buffers: list[torch.Tensor] = field(default_factory=list)  # a stage's other state, made equal with the params


def canonical_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in ``model.named_parameters()`` (a tied parameter: its first name)."""
    return {id(p): n for n, p in model.named_parameters()}


def tied_owners(stages: Sequence[StageGraph], names: dict[int, str],
                group_of: Sequence[int] | None = None) -> dict[tuple[int, ...], list[str]]:
    """Parameters used by more than one stage, grouped by the set of stages using them; with ``group_of`` (each
    stage's device group), only those whose stages lie on several device groups (one used by chunks of a single
    group is one tensor on each of its ranks, summed over the group's replicas like any of its own)."""
    users: dict[int, list[int]] = {}
    for st in stages:
        for p in st.parameters():
            users.setdefault(id(p), []).append(st.index)
    tied: dict[tuple[int, ...], list[str]] = {}
    for pid, owners in users.items():
        spread = len(owners) if group_of is None else len({group_of[s] for s in owners})
        if spread > 1:
            tied.setdefault(tuple(sorted(owners)), []).append(names[pid])
    return {k: sorted(v) for k, v in sorted(tied.items())}


def make_grad_groups(plan: Plan, stages: Sequence[StageGraph], names: dict[int, str], rank: int,
                     timeout: float, where: str) -> list[GradGroup]:
    """Create the gradient groups on every rank, in the same order; return those with their members.

    Order: replicated device groups by their first stage (a group holds one stage, or several chunks, whose own
    parameters it sums together), then tied-parameter owner sets in sorted order. A tied parameter is summed once
    over the union of its owning stages' ranks (so not again within its stage's replicas); one tied between chunks
    of a single device group is one tensor there, summed with the group's own.
    """
    layout = plan.chunks
    tied = tied_owners(stages, names, layout.group_of)
    tied_names = {n for ns in tied.values() for n in ns}
    specs: list[GradGroup] = []
    for g, devices in enumerate(layout.groups):
        chunks = [stages[s] for s in layout.stages_of(g)]
        ranks = list(devices)
        own = list(dict.fromkeys(names[id(p)] for st in chunks for p in st.parameters()
                                 if p.requires_grad and names[id(p)] not in tied_names))
        if len(ranks) > 1 and any(True for st in chunks for _ in st.module.state_dict()):  # anything to reduce
            label = ", ".join(str(st.index) for st in chunks)
            specs.append(GradGroup(f"stage{'s' if len(chunks) > 1 else ''} {label} replicas", ranks, own,
                                   root=ranks[0]))
    for owners, ns in tied.items():
        ranks = sorted({d for s in owners for d in plan.stages[s].devices})
        specs.append(GradGroup(f"tied parameters of stages {','.join(map(str, owners))}", ranks, ns,
                               spans_stages=True, root=plan.stages[owners[0]].devices[0]))
    mine_chunks = [stages[s] for s in plan.stages_of_device(rank)]
    mine = {names[id(p)]: p for st in mine_chunks for p in st.parameters()}
    for spec in specs:
        group = bounded(timeout, f"{where}: creating the group of the {spec.label} (ranks {spec.ranks})",
                        dist.new_group, spec.ranks,  # every rank, in order
                        timeout=group_timeout(timeout, dist.get_backend()))
        if rank in spec.ranks:
            spec.group = group
            spec.params = [mine[n] for n in spec.names]
            if not spec.spans_stages:  # what the stage holds but does not reduce: buffers, frozen parameters
                held = {id(t): t for st in mine_chunks for t in [*st.module.buffers(), *st.parameters()]
                        if not isinstance(t, nn.Parameter) or (not t.requires_grad and names[id(t)] not in tied_names)}
                spec.buffers = list(held.values())
    return [s for s in specs if s.group is not None]


def start_equal(groups: Sequence[GradGroup], timeout: float, who: str) -> None:
    """Give every member of each group its root's parameters (and a stage's buffers), as DDP does at wrapping:
    replicas and tied copies then start, and stay, equal even if the ranks built the model differently."""
    for g in groups:  # every member walks the groups in the same order
        works = [dist.broadcast(t.data, src=g.root, group=g.group, async_op=True) for t in [*g.params, *g.buffers]]
        for work in works:
            waited(work, timeout, who, f"dapple.pipeline: broadcasting {g.label}' initial values from rank {g.root}",
                   g.ranks)


class GradReducer:
    """Bucketed gradient AllReduce, overlapped with the step's last backward, on gradients that live in the buckets.

    Buckets hold a group's parameters in reverse order (the order backward finishes them). Each bucket is one flat
    buffer, and at the start of a step (:meth:`attach`) every bucketed parameter's ``.grad`` becomes its zeroed
    slice of it (as DDP's ``gradient_as_bucket_view``): autograd accumulates into the bucket, the AllReduce runs
    in place, and a stage holds its gradients once, not again in a copy for the AllReduce. While the last backward
    op runs (:meth:`arm`), a hook after each parameter's final gradient accumulation launches a bucket's async
    AllReduce as soon as all its parameters are done and the group's earlier buckets are launched (so every
    member launches the same buckets in the same order). :meth:`finish` launches the rest (parameters the last
    backward did not reach) and waits; a parameter no backward reached gets ``.grad`` None back, as on one device.

    Groups of tied parameters that span stages launch only in :meth:`finish`, after the step's sends: the
    last stage finishes the tied LM head's gradient early in its backward, but the first stage reaches the
    embedding only after that backward's gradients arrive. On NCCL an AllReduce launched there is a kernel
    that spins until the first stage joins, and a lazily loaded kernel or host sync later in the same
    backward waits for it, so the gradients are never sent: a deadlock (a replica group has no such cycle,
    as its members' backwards do not wait on each other).

    Args:
        groups: this rank's gradient groups, in the order every member walks them.
        bucket_bytes: the bucket size (``core.buckets``).
        reduce_dtype: the dtype gradients travel in (e.g. torch.bfloat16: half the bytes of fp32; each bucket is
            cast into a temporary of its size and back), or None: the gradients' own.
    """

    def __init__(self, groups: Sequence[GradGroup], bucket_bytes: int = BUCKET_BYTES,
                 reduce_dtype: torch.dtype | None = None):
        self.buckets: list[tuple[GradGroup, list[nn.Parameter]]] = []
        self._in_group: list[list[int]] = []  # per group: its bucket indices, in launch order
        for g in groups:  # same group order and bucket layout on every member
            mine = _buckets([p for p in reversed(g.params) if p.requires_grad], bucket_bytes)
            self._in_group.append(list(range(len(self.buckets), len(self.buckets) + len(mine))))
            self.buckets += [(g, b) for b in mine]
        self.reduce_dtype = reduce_dtype
        self._bucket_of = {id(p): i for i, (_, b) in enumerate(self.buckets) for p in b}
        self._group_of = [gi for gi, ks in enumerate(self._in_group) for _ in ks]  # bucket -> its group's index
        self._next: list[int] = []  # per group: how many of its buckets are launched (always a prefix)
        # each bucket's flat buffer (sum of its numels,): the gradients themselves, once attached
        self._flat: list[torch.Tensor] = [_flat_buffer(b) for _, b in self.buckets]
        self._storages = {f.untyped_storage().data_ptr() for f in self._flat}
        self._touched: set[int] = set()  # id of the parameters autograd accumulated into this step
        self._armed = False
        self._expect: dict[int, int] | None = None  # id(parameter) -> accumulations still to come (arm's)
        self._left: list[int] = []
        self._launched: list[tuple | None] = []
        self.rec: Any = None  # a tracing.Recorder while tracing, else None
        self._launch_times: list[tuple[float, str]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready) for _, params in self.buckets for p in params]

    def close(self) -> None:
        """Take the hooks off the parameters (a replaced pipeline's: they would keep the reducer, and through it the
        parameters and buckets, alive)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def holds(self, t: torch.Tensor) -> bool:
        """Whether tensor ``t`` lives in a bucket (a gradient attached earlier: :meth:`attach` overwrites it)."""
        return t.untyped_storage().data_ptr() in self._storages

    def attach(self) -> None:
        """Start of a step: each bucketed parameter's ``.grad`` becomes its zeroed slice of its bucket (the caller
        has put earlier gradients aside)."""
        self._touched = set()
        for flat, (_, params) in zip(self._flat, self.buckets):
            flat.zero_()
            offset = 0
            for p in params:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()

    def arm(self, expect: dict[int, int] | None = None) -> None:
        """From now on, launch each bucket once its gradients are final.

        Args:
            expect: per id(parameter), the accumulations into it still to come (a rank of several chunks arms once
                each has at most its last one left: a parameter used by two of them gets two, one whose chunks are
                done 0, final already); None: one each (armed before the last backward of a rank's only stage).
        """
        self._left = [len(b) for _, b in self.buckets]
        self._launched = [None] * len(self.buckets)
        self._next = [0] * len(self._in_group)
        self._expect = None if expect is None else dict(expect)
        self._armed = True
        if self.rec is not None:
            self._launch_times = [(0.0, "")] * len(self.buckets)
        if expect is not None:  # gradients already final count as done; their buckets may launch now
            for i, (_, params) in enumerate(self.buckets):
                self._left[i] -= sum(1 for p in params if not expect.get(id(p), 0))
            for gi in range(len(self._in_group)):
                self._advance(gi)

    def _ready(self, p: nn.Parameter) -> None:
        self._touched.add(id(p))
        i = self._bucket_of.get(id(p))
        if not self._armed or i is None or self.buckets[i][0].spans_stages:
            return
        if self._expect is not None:
            left = self._expect.get(id(p), 0)
            if left <= 0:
                return  # (not expected: counted as final when armed)
            self._expect[id(p)] = left - 1
            if left > 1:
                return  # another chunk of this rank still adds to it
        self._left[i] -= 1
        self._advance(self._group_of[i])

    def _advance(self, gi: int) -> None:
        """Launch group ``gi``'s buckets in order, while ready (never a tied group's that spans stages)."""
        ks, n = self._in_group[gi], self._next[gi]
        while n < len(ks) and self._left[ks[n]] == 0 and not self.buckets[ks[n]][0].spans_stages:
            self._launch(ks[n])
            n += 1
        self._next[gi] = n

    def _launch(self, k: int, have: list[bool] | None = None) -> None:
        """Start bucket k's AllReduce in place (``have``: which parameters some member has a gradient for; default:
        those this rank accumulated, the same on every replica); a bucket none has is skipped by every member."""
        g, bucket = self.buckets[k]
        have = have if have is not None else [id(p) in self._touched for p in bucket]
        if not any(have):
            self._launched[k] = (have, None, None)
            return
        flat = self._flat[k]
        wire = flat if self.reduce_dtype in (None, flat.dtype) else flat.to(self.reduce_dtype)  # (numel,)
        if self.rec is not None:
            self._launch_times[k] = (self.rec.clock(), "last backward" if self._armed else "end of step")
        self._launched[k] = (have, wire, dist.all_reduce(wire, group=g.group, async_op=True))

    def _agree(self, k: int, timeout: float, who: str, moment: str) -> list[bool] | None:
        """For a tied group's bucket: which parameters have a gradient on some member (one MAX AllReduce); a
        replica group needs none (its members run the same graph, so the same parameters get gradients)."""
        g, bucket = self.buckets[k]
        if not g.spans_stages:
            return None
        have = torch.tensor([id(p) in self._touched for p in bucket], dtype=torch.int32, device=bucket[0].device)
        waited(dist.all_reduce(have, op=dist.ReduceOp.MAX, group=g.group, async_op=True), timeout, who,
               f"{moment}: which tied parameters of {g.label} (ranks {g.ranks}) have gradients", g.ranks)
        return [bool(h) for h in have.tolist()]

    def finish(self, timeout: float, who: str, moment: str) -> None:
        """Launch what is left, wait for every bucket; a parameter no member has a gradient for gets None (errors
        say "``who``, ``moment``: ...")."""
        if not self._armed:
            self.arm()
        self._armed = False
        rec = self.rec
        start = rec.clock() if rec is not None else 0.0
        for k in range(len(self.buckets)):
            if self._launched[k] is None:
                self._launch(k, self._agree(k, timeout, who, moment))
        for k, (g, params) in enumerate(self.buckets):
            launch = self._launched[k]
            if launch is None:  # (every bucket was launched just above)
                raise RuntimeError(f"{who}, {moment}: the gradient AllReduce of bucket {k} ({g.label}) never started")
            have, wire, work = launch
            if work is not None:
                waited(work, timeout, who, f"{moment}: gradient AllReduce", g.ranks, detail=f" of {g.label} (ranks "
                       f"{g.ranks})")
                if wire is not self._flat[k]:
                    self._flat[k].copy_(wire)
                if rec is not None:
                    launched, during = self._launch_times[k]
                    rec.allreduce_bucket(k, launched, rec.clock(), g.label, g.ranks,
                                         wire.numel() * wire.element_size(), during)
            for p, h in zip(params, have):
                if not h:  # no backward reached it anywhere: .grad None, as on one device
                    p.grad = None
        if rec is not None and self.buckets:
            rec.allreduce_wait(start, rec.clock(), len(self.buckets))
        self._launched = []


def _flat_buffer(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """One bucket's buffer: room for every parameter's gradient, in their dtype, on their device."""
    return torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)


def _buckets(params: Sequence[nn.Parameter], limit: int) -> list[list[nn.Parameter]]:
    """Consecutive parameters by the bucketing rule (core.buckets), each bucket of one dtype and device (one flat
    buffer)."""
    kind = [(p.dtype, p.device) for p in params]
    groups = bucket([p.numel() * p.element_size() for p in params], limit, lambda i, j: kind[i] == kind[j])
    return [[params[i] for i in g] for g in groups]
