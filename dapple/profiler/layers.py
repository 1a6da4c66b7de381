"""Grouping an fx graph into layers: the units a plan may cut between, shared by profiler and runtime."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch.fx as fx
from torch import nn

from .export_graph import check_cuts, localise_sizes
from .export_trace import trace_graph
from .fx_trace import LeafSpec

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


@dataclass
class LayerGraph:
    """A traced model whose every call node belongs to exactly one layer.

    Along every graph edge the layer index never decreases, so a cut between any two consecutive
    layers is a valid split. Nodes that depend only on the model's inputs and attributes (``x.size(1)``,
    ``self.pos``) are copied into each layer that uses them, so they never cross a cut.
    """

    gm: fx.GraphModule
    names: list[str]  # layer names: module paths in the original model, in execution order
    layer_of: dict[fx.Node, int]  # every node except placeholders and output -> its layer index
    inputs: list[str] = field(default_factory=list)  # the model's forward() argument names

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def nodes(self, layer: int) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if self.layer_of.get(n) == layer]

    def stage_of_node(self, cuts: list[int]) -> dict[fx.Node, int]:
        """Map each node to its stage for stage boundaries ``cuts`` (layer index where each stage starts)."""
        import bisect
        return {n: bisect.bisect_right(cuts, k) - 1 for n, k in self.layer_of.items()}

    def crossing(self, layer: int) -> list[fx.Node]:
        """Nodes computed in layers <= ``layer`` that are used after it: what a cut after ``layer`` carries."""
        out = []
        for n, k in self.layer_of.items():
            if k <= layer and any(self._user_layer(u) > layer for u in n.users):
                out.append(n)
        return out

    def _user_layer(self, user: fx.Node) -> int:
        return self.num_layers - 1 if user.op == "output" else self.layer_of[user]

    def layer_inputs(self, layer: int) -> list[int]:
        """Indices of the earlier layers whose outputs ``layer`` reads."""
        return sorted({self.layer_of[a] for n in self.nodes(layer) for a in n.all_input_nodes
                       if a in self.layer_of and self.layer_of[a] < layer})

    def params_by_layer(self) -> list[list[tuple[str, Any]]]:
        """(name, tensor) of the parameters each layer uses; a tied parameter only at its first layer."""
        seen: set[int] = set()
        result: list[list[tuple[str, Any]]] = [[] for _ in self.names]
        named = dict(self.gm.named_parameters(remove_duplicate=False))
        for n in self.gm.graph.nodes:
            if n not in self.layer_of:
                continue
            if n.op == "call_module":
                mod = self.gm.get_submodule(n.target)
                pairs = [(f"{n.target}.{k}", p) for k, p in mod.named_parameters(remove_duplicate=False)]
            elif n.op == "get_attr" and n.target in named:
                pairs = [(n.target, named[n.target])]
            else:
                continue
            for name, p in pairs:
                if id(p) not in seen:
                    seen.add(id(p))
                    result[self.layer_of[n]].append((name, p))
        return result


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
    """Trace ``model`` and group its nodes into layers (see docs/design.md, Profile).

    ``method``: ``"fx"`` (torch.fx; ``concrete_args``/``leaf_modules`` apply), ``"export"`` (torch.export with
    ``example_inputs``, dim 0 dynamic, other dims per ``dynamic_shapes`` or dynamic where export allows; see
    dapple/profiler/export_trace.py), or ``"auto"``: fx, and export when fx fails and example inputs are given.
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
