"""The optimizer of a replanned pipeline: its param groups checked alike on every rank, then rebuilt in place over
the new stage's parameters, each in the group it was in, with its state."""

from __future__ import annotations

from typing import Any

import torch

from .reshard import PARAMETER, Held


def check_optimizer(optimizer: torch.optim.Optimizer | None, state: dict[str, tuple[str, torch.Tensor]]) -> None:
    """ValueError unless every parameter ``optimizer`` holds is one of the stage's (``state``: reshard.stage_state)."""
    if optimizer is None:
        return
    mine = {id(t) for kind, t in state.values() if kind == PARAMETER}
    for i, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            if id(p) not in mine:
                raise ValueError(f"replan: optimizer.param_groups[{i}] holds a tensor of shape {tuple(p.shape)} that "
                                 f"is not a parameter of this rank's stage (build the optimizer from "
                                 f"pipe.parameters())")


def hypers(optimizer: torch.optim.Optimizer | None) -> list[dict] | None:
    """The optimizer's param groups without their parameters (tensors on the CPU), or None."""
    if optimizer is None:
        return None
    return [{k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


def check_groups(every: list[list[dict] | None]) -> None:
    """ValueError unless every rank passed an optimizer with the same param groups' hyperparameters, or none did:
    group i of the new optimizer takes the parameters that were in group i, so groups must mean the same."""
    given = [r for r, g in enumerate(every) if g is not None]
    if given and len(given) != len(every):
        raise ValueError(f"replan: ranks {given} passed an optimizer, ranks "
                         f"{sorted(set(range(len(every))) - set(given))} did not (pass it on every rank or on none)")
    for r, groups in enumerate(every[1:], 1):
        if groups is not None and not same(groups, every[0]):
            raise ValueError(f"replan: rank {r}'s optimizer has other param groups than rank 0's ({len(groups)} vs "
                             f"{len(every[0] or [])} groups, or other hyperparameters): each rank's groups must be "
                             f"the same list (an empty group where its stage has no such parameter)")


def same(a: Any, b: Any) -> bool:
    """Equality of hyperparameter values that may be tensors, tuples or dicts."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(
            torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def rebuild_optimizer(optimizer: torch.optim.Optimizer, target: dict[str, tuple[str, torch.Tensor]],
                       held: dict[str, Held], values: dict[str, tuple]) -> None:
    """``optimizer`` made over the new stage's parameters, in place (an LR scheduler of it keeps working): the same
    param groups and hyperparameters, each parameter in the group it was in, with its state."""
    hypers = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    params: list[list[torch.Tensor]] = [[] for _ in hypers]
    state: dict[torch.Tensor, dict] = {}
    for key, (kind, t) in target.items():
        h = held[key]
        if kind != PARAMETER or h.group is None:
            continue
        params[h.group].append(t)
        st = {**h.objects, **{name: v for (name, _), v in zip(h.state, values[key][2])}}
        if st:
            state[t] = st
    optimizer.param_groups.clear()
    optimizer.state.clear()
    for hyper, ps in zip(hypers, params):
        optimizer.add_param_group({**hyper, "params": ps})
    optimizer.state.update(state)
