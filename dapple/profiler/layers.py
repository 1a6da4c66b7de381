"""Tracing a model and grouping its graph into layers, the units a plan cuts between (profiler and runtime)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch.fx as fx
from torch import nn

from .export_graph import check_cuts, localise_sizes
from .export_trace import trace_graph
from .fx_trace import LeafSpec
from .layer_graph import LayerGraph

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(frozen=True)
class Arity:
    """How many positional inputs a traced model takes: at least ``need``, at most ``len(names)``."""

    names: list[str]  # the graph's inputs (forward's arguments; fx renames concrete ones, e.g. flag_1)
    need: int  # up to the last without a default, or whose default None the graph uses as a tensor
    traced_none: list[str]  # inputs defaulting to None that the graph uses as tensors

    def check(self, given: int, what: str) -> None:
        """ValueError naming the inputs unless ``given`` of them are enough and not too many."""
        if self.need <= given <= len(self.names):
            return
        want = f"{self.need}" if self.need == len(self.names) else f"{self.need} to {len(self.names)}"
        why = ""
        if given < self.need and self.traced_none:
            nones = ", ".join(f"{n!r}: None" for n in self.traced_none)
            why = (f"; {self.traced_none} default to None but the model was traced with them as tensors (torch.fx "
                   f"takes `if x is not None` branches): pass them, or trace with concrete_args={{{nones}}}")
        raise ValueError(f"{what}: the model takes {want} inputs {self.names}, got {given}{why}")


def arity(gm: fx.GraphModule) -> Arity:
    """The inputs a call of traced ``gm`` must give. A placeholder defaulting to None is used as a tensor unless
    its only users are fx's ``_assert_is_none`` (what ``concrete_args={'mask': None}`` leaves)."""
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    traced_none = [n.name for n in nodes if n.args and n.args[0] is None
                   and any(getattr(u.target, "__name__", None) != "_assert_is_none" for u in n.users)]
    need = max((i + 1 for i, n in enumerate(nodes) if not n.args or n.name in traced_none), default=0)
    return Arity([n.name for n in nodes], need, traced_none)


def layer_units(model: nn.Module) -> list[str]:
    """Candidate layer paths: top-level children, containers (ModuleList/Sequential) expanded one level."""
    units = []
    for name, child in model.named_children():
        if isinstance(child, CONTAINERS) and len(child) > 0:
            units.extend(f"{name}.{sub}" for sub, _ in child.named_children())
        else:
            units.append(name)
    return units


def _owner(node: fx.Node, units: set[str]) -> str | None:
    """The layer unit a node belongs to: the outermost unit in its module stack, or None."""
    paths: list[str] = []
    stack = node.meta.get("nn_module_stack") or {}
    for key, value in stack.items():
        paths.append(value[0] if isinstance(value, tuple) else key)
    if node.op == "call_module":
        paths.append(node.target)
    for path in paths:
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in units:
                return prefix
    return None


def trace_layers(model: nn.Module, concrete_args: dict[str, Any] | None = None, leaf_modules: LeafSpec = (), *,
                 method: str = "auto", example_inputs: Any = None, dynamic_shapes: Any = None) -> LayerGraph:
    """Trace ``model`` and group its nodes into layers (top-level children, containers expanded one level).

    Args:
        model: the module to trace.
        concrete_args: Python-level arguments fixed for torch.fx (``{"mask": None}``).
        leaf_modules: module classes or qualified names torch.fx keeps as opaque calls.
        method: ``"fx"`` (torch.fx; ``concrete_args``/``leaf_modules`` apply), ``"export"`` (torch.export with
            ``example_inputs``, dim 0 dynamic, other dims per ``dynamic_shapes`` or dynamic where export allows;
            see :mod:`dapple.profiler.export_trace`), or ``"auto"``: fx, and export when fx fails and example
            inputs are given.
        example_inputs: the model's positional inputs (a tensor or tuple of tensors), for torch.export.
        dynamic_shapes: torch.export's per-input dynamic dims (dim 0 is always dynamic).

    Returns:
        The :class:`LayerGraph`. Raises :class:`~dapple.profiler.TraceError` if the model cannot be traced.
    """
    gm = trace_graph(model, method=method, concrete_args=concrete_args, leaf_modules=leaf_modules,
                     example_inputs=example_inputs, dynamic_shapes=dynamic_shapes)
    lg = group_layers(gm, layer_units(model))
    if gm.meta.get("dapple_trace", {}).get("method") == "export":
        localise_sizes(lg)  # blocks read sizes off their own inputs, not the model's
        check_cuts(lg)
    return lg


def group_layers(gm: fx.GraphModule, units: Iterable[str]) -> LayerGraph:
    """Assign layers to the nodes of ``gm``; see :class:`LayerGraph` for the guarantees."""
    units = set(units)
    nodes = list(gm.graph.nodes)
    rank: dict[str, int] = {}  # unit -> order of first appearance
    owner: dict[fx.Node, str | None] = {}
    for n in nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            owner[n] = None  # inputs and attributes join whichever layers use them
            continue
        owner[n] = _owner(n, units)
        if owner[n] is not None:
            rank.setdefault(owner[n], len(rank))
    if not rank:
        raise ValueError(f"{type(gm).__name__}: no layer found; the model calls none of its children "
                         f"({sorted(units)}), so there is nothing to cut between")

    # Forward pass: a node sits no earlier than its own module's layer and any of its inputs' layers.
    level: dict[fx.Node, int | None] = {}
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        ins = [level[a] for a in n.all_input_nodes if level.get(a) is not None]
        own = [rank[owner[n]]] if owner[n] is not None else []
        level[n] = max(own + ins) if own or ins else None
    # Backward pass: input-only nodes (no owner, depend only on inputs/attributes) join their users.
    _place_input_only_nodes(gm, level, last=max(rank.values()))
    gm.recompile()

    # Layers are the ranks that kept nodes, renumbered densely (a module reused later joins later layers).
    used = sorted({k for k in level.values()})
    dense = {k: i for i, k in enumerate(used)}
    by_rank = {r: u for u, r in rank.items()}
    names = [by_rank[k] for k in used]
    layer_of = {n: dense[k] for n, k in level.items()}
    inputs = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    return LayerGraph(gm=gm, names=names, layer_of=layer_of, inputs=inputs)


def _place_input_only_nodes(gm: fx.GraphModule, level: dict[fx.Node, int | None], last: int) -> None:
    """Place each unplaced node in its users' layer, copying it for every further layer that uses it."""
    graph = gm.graph
    for n in reversed(list(graph.nodes)):  # users come later, so they are placed before n is reached
        if n.op in ("placeholder", "output") or level[n] is not None:
            continue
        by_level: dict[int, list[fx.Node]] = {}
        for u in n.users:
            by_level.setdefault(last if u.op == "output" else level[u], []).append(u)
        if not by_level:  # dead code: nothing uses it
            level[n] = 0
            continue
        first, *later = sorted(by_level)
        level[n] = first
        for k in later:  # a copy per later layer, so the value never crosses a cut
            with graph.inserting_after(n):
                copy = graph.node_copy(n, lambda a: a)
            level[copy] = k
            for u in by_level[k]:
                u.replace_input_with(n, copy)
