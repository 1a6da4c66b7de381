"""ZeRO-1: a stage's optimizer state sharded over its replicas; each steps the parameters it owns and broadcasts them.

A stage on r replicas holds every parameter and its whole gradient on each (the AllReduce sums them), so each replica
can step any parameter. Here each steps only its share, balanced by bytes, and holds only that share's optimizer
state (Adam's two moments: 1/r of them), then sends what it stepped to the others::

    replica 0: step [w0, b2]  --broadcast-->  replicas 1, 2
    replica 1: step [w1]      --broadcast-->  replicas 0, 2
    replica 2: step [w2, b1]  --broadcast-->  replicas 0, 1

The update of each parameter is computed once, by the same optimizer arithmetic as unsharded, so training is
unchanged to the bit. A parameter tied across stages is stepped by one replica of each stage holding it, from the
same gradient and state: its copies stay equal, as unsharded.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .engine import Pipeline
from .roll import post, waited


def partition(sizes: Sequence[tuple[str, int]], replicas: int) -> dict[str, int]:
    """Which replica (0 .. ``replicas`` - 1) owns each parameter (``sizes``: name, bytes): the largest first, each to
    the replica holding the fewest bytes so far (the lowest index on ties). The same on every replica: it depends
    only on names and sizes."""
    loads = [0] * replicas
    owner = {}
    for name, nbytes in sorted(sizes, key=lambda s: (-s[1], s[0])):
        i = min(range(replicas), key=lambda j: (loads[j], j))
        owner[name] = i
        loads[i] += nbytes
    return owner


class ShardedOptimizer(torch.optim.Optimizer):
    """An optimizer whose state is sharded over the replicas of this rank's stage (ZeRO-1); see
    :func:`shard_optimizer`.

    It holds every parameter of the stage in ``param_groups`` (what LR schedulers and ``zero_grad`` see, with the
    hyperparameters ``optimizer_class`` would have), and its own shard's optimizer in ``optim``, whose ``state`` is
    ``self.state``: this rank's parameters' state only. ``state_dict()`` is therefore this rank's share (it loads
    back on this rank under the same plan); :func:`dapple.save_checkpoint` saves every share by name.

    Attributes:
        optimizer_class: the optimizer each replica runs on its shard (what a checkpoint's state is for).
        optim: that optimizer over the parameters this rank owns (None where it owns none).
        group: the process group of the stage's replicas (None: one replica, which owns everything).
        ranks: the stage's ranks, in replica order.
    """

    def __init__(self, pipe: Pipeline, optimizer_class: type[torch.optim.Optimizer],
                 params: Iterable[Any] | None = None, **defaults: Any):
        if not isinstance(pipe, Pipeline):
            raise TypeError(f"pipe: expected a dapple.Pipeline (from dapple.pipeline(...)), got {type(pipe).__name__}")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class: expected a torch.optim.Optimizer class (e.g. torch.optim.AdamW), got "
                            f"{optimizer_class!r}")
        self.optimizer_class = optimizer_class
        self._ready = False
        # the class's own defaults (and its checks of ``defaults``), from an optimizer of an empty tensor
        full = optimizer_class([nn.Parameter(torch.empty(0, device=pipe.ctx.device))], **defaults).defaults
        super().__init__(list(pipe.parameters()) if params is None else params, full)
        self.ranks = list(pipe.plan.stages[pipe.stage].devices)
        self.group = pipe.replica_group
        self.timeout, self._who = pipe.timeout, pipe.who
        self._pipe_step: Callable[[], int] = lambda: pipe.global_step
        names = dict((id(p), n) for n, p in pipe.named_parameters())
        self._names = [_name_of(names, i, p) for i, g in enumerate(self.param_groups) for p in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        owner = partition([(n, p.numel() * p.element_size() if p.requires_grad else 0)
                           for n, p in zip(self._names, params)], len(self.ranks))
        self._owner = {id(p): self.ranks[owner[n]] for n, p in zip(self._names, params)}
        self._rank = pipe.ctx.rank
        # this rank's optimizer: each param group's owned parameters, the groups it owns none of left out
        self._pairs = [(i, [p for p in g["params"] if self.owns(p)]) for i, g in enumerate(self.param_groups)]
        self._pairs = [(i, ps) for i, ps in self._pairs if ps]
        self.optim = optimizer_class([{**_hyper(self.param_groups[i]), "params": ps} for i, ps in self._pairs],
                                     **defaults) if self._pairs else None
        if self.optim is not None:
            self.state = self.optim.state
        self._sent = [(p, self._owner[id(p)], n) for n, p in zip(self._names, params) if p.requires_grad]
        self._ready = True

    def owns(self, p: torch.Tensor) -> bool:
        """Whether this rank steps parameter ``p`` and holds its optimizer state."""
        return self._owner.get(id(p)) == self._rank

    def owner(self, p: torch.Tensor) -> int:
        """The rank that steps parameter ``p``."""
        return self._owner[id(p)]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_ready", False):
            raise ValueError("ShardedOptimizer.add_param_group: the shards are fixed when it is built; give every "
                             "param group to dapple.shard_optimizer(pipe, cls, [group, ...])")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """Step this rank's shard (with the hyperparameters of ``param_groups``: a scheduler's changes), then
        broadcast each stepped parameter from its owner to the stage's other replicas (every replica calls it)."""
        if closure is not None:
            raise TypeError("ShardedOptimizer.step: no closure (it would run the model on this rank alone); run "
                            "pipe.train_step first, then step()")
        for i, inner in zip((i for i, _ in self._pairs), self.optim.param_groups if self.optim else ()):
            inner.update(_hyper(self.param_groups[i]))
        if self.optim is not None:
            self.optim.step()
        if self.group is not None:
            self._broadcast()

    def _broadcast(self) -> None:
        where = f"optimizer step after step {self._pipe_step()}: broadcasting each replica's updated parameters"
        post(self._who, where)  # (before launching, so a rank that is elsewhere is named)
        works = [dist.broadcast(p.detach(), src=src, group=self.group, async_op=True) for p, src, _ in self._sent]
        for work, (_, src, name) in zip(works, self._sent):
            waited(work, self.timeout, self._who, where, self.ranks, detail=f" ({name!r} from rank {src})")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an optimizer ``state_dict`` of every parameter (indexed as ``param_groups`` lists them, as
        ``torch.optim.Optimizer.state_dict`` writes it): this rank keeps the state of the parameters it owns."""
        index = [p for g in self.param_groups for p in g["params"]]
        mine = {i: s for i, s in state_dict["state"].items() if isinstance(i, int) and i < len(index)
                and self.owns(index[i])}
        super().load_state_dict({**state_dict, "state": mine})
        if self.optim is not None:
            self.optim.state = self.state

    def state_bytes(self) -> int:
        """Bytes of the optimizer state this rank holds (its shard's tensors)."""
        return sum(v.numel() * v.element_size() for st in self.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor))


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _name_of(names: dict[int, str], i: int, p: torch.Tensor) -> str:
    if id(p) not in names:
        raise ValueError(f"param group {i} holds a tensor of shape {tuple(p.shape)} that is not a parameter of this "
                         f"rank's stage (give pipe.parameters() or groups of them)")
    return names[id(p)]


def shard_optimizer(pipe: Pipeline, optimizer_class: type[torch.optim.Optimizer],
                    params: Iterable[Any] | None = None, **defaults: Any) -> ShardedOptimizer:
    """An optimizer for this rank's stage whose state is sharded over the stage's replicas (ZeRO-1); call on every
    rank, as ``optimizer_class(params, **defaults)`` would be called.

    Each parameter of the stage is owned by one of its replicas (balanced by bytes); ``step()`` steps the owned
    ones with ``optimizer_class`` and broadcasts them to the other replicas, so a stage on r replicas holds 1/r of
    its optimizer state on each (``dapple.plan(..., shard_optimizer=True)`` prices that). Training is the same, to
    the bit, as with ``optimizer_class`` unsharded. A stage of one replica owns everything (no collective).
    Everything else is as with a torch optimizer: ``zero_grad``, LR schedulers, ``pipe.scaler.step(opt)`` under
    fp16, ``pipe.clip_grad_norm_`` (the gradients stay whole on every replica), and
    :func:`dapple.save_checkpoint` / :func:`dapple.load_checkpoint`, where each owner writes its parameters'
    state by name and a load under any plan, sharded or not, routes it to the new owners.

    Args:
        pipe: this rank's pipeline.
        optimizer_class: e.g. ``torch.optim.AdamW``; any optimizer whose state is per parameter.
        params: ``pipe.parameters()`` (the default) or param groups of them (dicts with ``"params"``).
        defaults: the optimizer's keyword arguments (``lr=3e-4, weight_decay=0.1``).

    Returns:
        A :class:`ShardedOptimizer`.

    Raises:
        TypeError, ValueError: a bad class or argument, or a parameter not of this stage (naming it).
    """
    return ShardedOptimizer(pipe, optimizer_class, params, **defaults)
