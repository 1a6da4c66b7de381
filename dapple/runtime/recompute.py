"""Activation recomputation per stage: which stages recompute and how (the whole stage, layer by layer, or selective),
and what cannot be recomputed faithfully."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

from ..core.plan import RECOMPUTE, Recompute, recompute_value
from ..core.selective import selective_contexts
from .stages import modified_in_place


def recomputing(plan: Any, recompute: Any) -> list[Recompute]:
    """Per stage, whether and how it recomputes its forward in the backward (``core.plan.RECOMPUTE``).

    Args:
        plan: the plan; its stages' ``recompute`` fields are the default.
        recompute: None (as the plan says), one mode for every stage (False, True, "layers", "selective"), or one
            mode per stage.
    """
    if recompute is None:
        return [s.recompute for s in plan.stages]
    if recompute_value(recompute):
        return [recompute] * plan.num_stages
    flags = list(recompute) if isinstance(recompute, Sequence) and not isinstance(recompute, str) else None
    if flags is None or len(flags) != plan.num_stages or not all(recompute_value(f) for f in flags):
        raise ValueError(f"recompute: expected None (the plan's), one of {RECOMPUTE} or one of them per stage "
                         f"({plan.num_stages}), got {recompute!r}")
    return flags


def check_recomputable(module: nn.Module, stage: int) -> None:
    """ValueError unless running the stage's forward twice per micro-batch trains as running it once: a BatchNorm
    in training mode would update its running statistics twice."""
    norms = [name for name, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if isinstance(module, fx.GraphModule):
        norms += [n.name for n in module.graph.nodes if "batch_norm" in str(n.target) and n.op == "call_function"]
    if norms:
        raise ValueError(f"recompute: stage {stage} holds batch normalisation ({norms[:3]}), whose running "
                         f"statistics the recomputed forward would update a second time; recompute other stages")


def run_recomputed(fn: Callable[..., Any], args: Sequence[Any], mode: Recompute) -> Any:
    """``fn(*args)`` keeping for the backward what ``mode`` keeps: True, the inputs only (the whole forward runs
    again); "selective", the inputs and the outputs of ``core.selective.SAVED_OPS``. (A "layers" stage's module
    checkpoints each layer itself: :func:`layered_module`.)"""
    if mode == "selective":
        return checkpoint(fn, *args, use_reentrant=False, context_fn=selective_contexts)
    return checkpoint(fn, *args, use_reentrant=False)


def _run_layer(layer: nn.Module, cloned: tuple[int, ...], *args: Any) -> Any:
    """One layer of a "layers" stage: checkpointed while autograd records (its inputs kept, its activations
    recomputed in the backward); the inputs it changes in place (``cloned``) go in as copies, so the recomputation
    sees what the forward saw."""
    if not torch.is_grad_enabled():
        return layer(*args)
    args = tuple(a.clone() if i in cloned and isinstance(a, torch.Tensor) else a for i, a in enumerate(args))
    return checkpoint(layer, *args, use_reentrant=False)


def layered_module(module: fx.GraphModule, layer_of: dict[str, int]) -> fx.GraphModule:
    """``module`` (a stage's graph) run layer by layer, each layer checkpointed: a micro-batch in flight keeps every
    layer's inputs, and the backward recomputes one layer at a time. ``layer_of``: node name -> its layer; a node
    of none goes with the latest layer of its inputs. Parameters and submodules are ``module``'s own."""
    part: dict[str, int] = {}
    for n in module.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        deps = [part[a.name] for a in n.all_input_nodes if a.name in part]
        part[n.name] = max([layer_of.get(n.name, -1), *deps, 0])
    for n in module.graph.nodes:  # a parameter's read goes with its first user
        if n.op == "get_attr":
            part[n.name] = min((part[u.name] for u in n.users if u.name in part), default=0)
    split = split_module(module, module, lambda n: part[n.name])  # (partitions in dependency order)
    graph = split.graph
    for n in list(graph.nodes):
        if n.op == "call_module" and n.target.startswith("submod_"):
            cloned = _changed_inputs(split.get_submodule(n.target))
            with graph.inserting_before(n):
                layer = graph.get_attr(n.target)
                call = graph.call_function(_run_layer, (layer, cloned, *n.args), dict(n.kwargs))
            n.replace_all_uses_with(call)
            graph.erase_node(n)
    split.recompile()
    return split


def _changed_inputs(gm: nn.Module) -> tuple[int, ...]:
    """The positions, among a layer's inputs, of those it changes in place (``stages.modified_in_place``)."""
    if not isinstance(gm, fx.GraphModule):
        return ()
    changed = modified_in_place(gm)
    holders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return tuple(i for i, name in enumerate(holders) if name in changed)
