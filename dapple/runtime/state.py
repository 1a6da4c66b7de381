"""A stage's parameters and buffers under the original model's ``state_dict`` names: reading and loading them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class StateNames:
    """This stage's tensors in the original model's ``state_dict``: ``names`` maps id(tensor) -> every key it has
    there (a tied parameter: several); ``order`` is the model's keys held by any stage, in its order.
    Non-persistent buffers (``position_ids``), which the model's ``state_dict`` leaves out, have no names."""

    names: dict[int, list[str]]
    order: list[str]


def model_keys(model: nn.Module) -> dict[int, list[str]]:
    """id(tensor) -> its keys in ``model.state_dict()``, in order (persistent buffers only, as torch has them)."""
    keys: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        keys.setdefault(id(t), []).append(name)
    return keys


def stage_keys(module: nn.Module, keys: dict[int, list[str]]) -> dict[str, list[str]]:
    """Each key of the stage ``module``'s own ``state_dict`` -> the model's keys of its tensor (``keys``, from
    :func:`model_keys` of the model it was cut from, before anything moved)."""
    return {k: keys.get(id(t), []) for k, t in module.state_dict(keep_vars=True).items()}


def held_keys(model: nn.Module, stages: Sequence[nn.Module]) -> list[str]:
    """The model's ``state_dict`` keys, in its order, of the tensors some stage module holds (a parameter no
    stage uses belongs to no stage), before anything moved."""
    held = {id(t) for m in stages for t in m.state_dict(keep_vars=True).values()}
    return [k for k, t in model.state_dict(keep_vars=True).items() if id(t) in held]


def state_names(module: nn.Module, by_key: dict[str, list[str]], order: list[str]) -> StateNames:
    """The :class:`StateNames` of ``module`` (moved to its device since :func:`stage_keys` named its keys)."""
    names = {id(t): by_key[k] for k, t in module.state_dict(keep_vars=True).items() if by_key.get(k)}
    return StateNames(names, order)


def own_tensors(module: nn.Module, names: StateNames) -> dict[str, torch.Tensor]:
    """Model key -> this stage's tensor, in the model's order (a tensor under each of its keys)."""
    own: dict[str, torch.Tensor] = {}
    for t in module.state_dict(keep_vars=True).values():
        for key in names.names.get(id(t), []):
            own[key] = t
    return {key: own[key] for key in names.order if key in own}


class LoadResult(NamedTuple):
    """What :func:`load_state` left out: this stage's keys the state dict lacks, and its keys no model has."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_state(module: nn.Module, names: StateNames, state: Mapping[str, Any], strict: bool, where: str
               ) -> LoadResult:
    """Copy ``state`` into this stage's tensors by the model's keys; keys of other stages are skipped. With
    ``strict``, a missing key of this stage or a key the model does not have is a ValueError naming them."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state_dict: expected a mapping of names to tensors, got {type(state).__name__}")
    own = own_tensors(module, names)
    known = set(names.order)
    result = LoadResult([k for k in own if k not in state], [k for k in state if k not in known])
    if strict and (result.missing_keys or result.unexpected_keys):
        raise ValueError(f"{where}: load_state_dict(strict=True): missing keys {_few(result.missing_keys)}, "
                         f"keys the model does not have {_few(result.unexpected_keys)}")
    bad = [f"{k}: given {_shape(state[k])}, model {tuple(t.shape)}" for k, t in own.items()
           if k in state and (not isinstance(state[k], torch.Tensor) or state[k].shape != t.shape)]
    if bad:
        raise ValueError(f"{where}: load_state_dict: shapes differ: {'; '.join(bad[:6])}")
    with torch.no_grad():
        for k, t in own.items():
            if k in state:
                t.copy_(state[k])
    return result


def _shape(x: Any) -> Any:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _few(keys: list[str], n: int = 6) -> str:
    return "[]" if not keys else "[" + ", ".join(repr(k) for k in keys[:n]) + (", ...]" if len(keys) > n else "]")
