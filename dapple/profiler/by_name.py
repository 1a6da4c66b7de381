"""Inputs given by name (a dict, transformers' ``BatchEncoding``): passed to ``forward`` by keyword, traced with only
those as the model's inputs, and put in the traced model's positional order."""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Sequence

import torch.fx as fx
from torch import Tensor, nn


def keyword_tensors(value: Any, what: str, empty: bool = False) -> dict[str, Tensor] | None:
    """A mapping of tensors by ``forward``'s argument names (a dict, transformers' ``BatchEncoding``) as a dict
    (an empty one only with ``empty``); None for anything else. TypeError naming ``what[key]`` for a value that is
    no tensor."""
    if not isinstance(value, Mapping):
        return None
    if not value and not empty:
        raise TypeError(f"{what}: expected tensors by name, got an empty {type(value).__name__}")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, Tensor):
            raise TypeError(f"{what}[{k!r}]: expected a tensor (batch rows along dim 0) under an argument name, got "
                            f"{type(v).__name__} {v!r:.60}; fix Python-level arguments with concrete_args instead")
    return dict(value)


def by_position(values: Mapping[str, Any], names: Sequence[str], what: str, gaps: bool = True) -> tuple[Any, ...]:
    """Tensors given by name as the traced model's positional inputs (``names``: its inputs, in order), up to the
    last one given; None for one not given before it (with ``gaps``; else a ValueError naming it).

    Raises:
        ValueError: a name that is not an input of the traced model.
    """
    unknown = [k for k in values if k not in names]
    if unknown:
        raise ValueError(f"{what}: {unknown} are not inputs of the traced model, which takes {list(names)}: trace it "
                         f"with every input it is given by name (example_inputs={{'name': tensor, ...}}, or a plan "
                         f"from a profile made so)")
    out = tuple(values.get(n) for n in names[:1 + max(names.index(k) for k in values)])
    missing = [n for n, v in zip(names, out) if v is None]
    if missing and not gaps:
        raise ValueError(f"{what}: {missing} not given, but the traced model takes them before "
                         f"{[n for n in names if n in values][-1]!r} (its inputs: {list(names)})")
    return out


def absent_arguments(model: nn.Module, named: dict[str, Any], concrete_args: dict[str, Any] | None
                     ) -> dict[str, Any]:
    """``forward``'s arguments with a default that inputs by name leave out (and ``concrete_args`` does not fix):
    their defaults, fixed for torch.fx (which would otherwise trace ``if mask is not None`` as taken).

    Raises:
        ValueError: a name ``forward`` does not take, or a required argument missing.
    """
    params = inspect.signature(model.forward).parameters
    plain = {k: p for k, p in params.items() if p.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                              inspect.Parameter.VAR_KEYWORD)}
    unknown = [k for k in named if k not in plain]
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise ValueError(f"example_inputs: {unknown} are not arguments of {type(model).__name__}.forward "
                         f"{list(plain)}")
    missing = [k for k, p in plain.items() if p.default is inspect.Parameter.empty and k not in named
               and k not in (concrete_args or {})]
    if missing:
        raise ValueError(f"example_inputs: {type(model).__name__}.forward needs {missing}, which the inputs by "
                         f"name ({list(named)}) lack")
    return {k: p.default for k, p in plain.items() if k not in named and k not in (concrete_args or {})
            and p.default is not inspect.Parameter.empty}


def given_first(gm: fx.GraphModule, names: list[str]) -> None:
    """Reorder ``gm``'s inputs: those given by name first (in ``forward``'s order), then the fixed ones, so a call
    by position gives the inputs by name and leaves the rest to their defaults."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    order = [n for n in placeholders if n.target in names] + [n for n in placeholders if n.target not in names]
    if order == placeholders:
        return
    anchor = placeholders[0]
    for n in reversed(order):
        anchor.prepend(n)
        anchor = n
    gm.recompile()
