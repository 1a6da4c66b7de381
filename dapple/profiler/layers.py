"""Tracing a model and grouping its graph into layers, the units a plan cuts between (profiler and runtime)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Sequence, cast

import torch.fx as fx
from torch import nn

from .boundary import is_size
from .export_graph import check_cuts, localise_sizes
from .export_trace import trace_graph
from .fx_trace import LeafSpec
from .layer_graph import LayerGraph
from .outputs import is_output_structure
from .units import layering


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


def _checks_only(u: fx.Node) -> bool:
    """A use that only checks an input (fx's ``_assert_is_none``, torch.export's ``_guards_fn`` of every input),
    not one that computes with it."""
    return getattr(u.target, "__name__", None) == "_assert_is_none" or (u.op == "call_module"
                                                                         and u.target == "_guards_fn")


def arity(gm: fx.GraphModule) -> Arity:
    """The inputs a call of traced ``gm`` must give. A placeholder defaulting to None is used as a tensor unless
    its only users check it (what ``concrete_args={'mask': None}`` leaves, under torch.fx and torch.export)."""
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    traced_none = [n.name for n in nodes if n.args and n.args[0] is None
                   and any(not _checks_only(u) for u in n.users)]
    need = max((i + 1 for i, n in enumerate(nodes) if not n.args or n.name in traced_none), default=0)
    return Arity([n.name for n in nodes], need, traced_none)


def _owner(node: fx.Node, units: set[str]) -> str | None:
    """The layer unit a node belongs to: the outermost unit in its module stack, or None."""
    paths: list[str] = []
    stack = node.meta.get("nn_module_stack") or {}
    for key, value in stack.items():
        paths.append(value[0] if isinstance(value, tuple) else key)
    if node.op == "call_module":
        paths.append(cast(str, node.target))  # a call_module's target: the module's path
    for path in paths:
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in units:
                return prefix
    return None


def trace_layers(model: nn.Module, concrete_args: dict[str, Any] | None = None, leaf_modules: LeafSpec = (), *,
                 tracer: str = "auto", example_inputs: Any = None, dynamic_shapes: Any = None,
                 layers: Sequence[str] | None = None, method: str | None = None) -> LayerGraph:
    """Trace ``model`` and group its nodes into layers: by default each block of its stacks of repeated blocks
    (``transformer.h.0``, ``bert.encoder.layer.0``, ``model.layers.0``) and, at each depth on the way down to
    them, the modules beside them (embeddings, final norm, head); see :func:`~dapple.profiler.units.layering`.

    Args:
        model: the module to trace.
        concrete_args: Python-level arguments fixed for the tracer (``{"mask": None}``); ``use_cache=False`` is
            added for a ``forward`` that takes ``use_cache`` (training never wants a cache).
        leaf_modules: module classes or qualified names torch.fx keeps as opaque calls.
        tracer: ``"fx"`` (torch.fx; ``concrete_args``/``leaf_modules`` apply), ``"export"`` (torch.export with
            ``example_inputs``, dim 0 dynamic, other dims per ``dynamic_shapes`` or dynamic where export allows;
            see :mod:`dapple.profiler.export_trace`), or ``"auto"``: fx, and export when fx fails and example
            inputs are given (the same name as :func:`dapple.profile`'s and :func:`dapple.pipeline`'s).
        example_inputs: the model's inputs: a tensor or tuple of tensors (positional), or tensors by name (a dict,
            a ``BatchEncoding``: passed to ``forward`` by keyword, the traced model's only inputs), for torch.export
            and, by name, for torch.fx too.
        dynamic_shapes: torch.export's per-input dynamic dims (dim 0 is always dynamic).
        layers: module paths that each become a layer, instead of the default rule (operations of no listed
            module join a neighbouring layer).
        method: the former name of ``tracer`` (deprecated).

    Returns:
        The :class:`LayerGraph`. Raises :class:`~dapple.profiler.TraceError` if the model cannot be traced.
    """
    if method is not None:
        warnings.warn("trace_layers(method=...) is deprecated: pass tracer=... (the name dapple.profile and "
                      "dapple.pipeline use)", DeprecationWarning, stacklevel=2)
        tracer = method
    rule = layering(model, layers)  # a bad path fails before tracing
    gm = trace_graph(model, method=tracer, concrete_args=concrete_args, leaf_modules=leaf_modules,
                     example_inputs=example_inputs, dynamic_shapes=dynamic_shapes)
    lg = group_layers(gm, rule.units)
    lg.layering = rule
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
        owner[n] = unit = _owner(n, units)
        if unit is not None:
            rank.setdefault(unit, len(rank))
    if not rank:
        raise ValueError(f"{type(gm).__name__}: no layer found; the model calls none of its children "
                         f"({sorted(units)}), so there is nothing to cut between")
    last = max(rank.values())

    # Forward pass: a node sits no earlier than its own module's layer and any of its inputs' layers.
    level: dict[fx.Node, int | None] = {}
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        ins = [k for k in (level.get(a) for a in n.all_input_nodes) if k is not None]
        unit = owner[n]
        own = [rank[unit]] if unit is not None else []
        level[n] = last if is_output_structure(n) else max(own + ins) if own or ins else None
    # Backward pass: values computed from sizes and attributes alone (positions, masks, rotary tables) and
    # unowned ones computed from inputs alone never cross a cut: every other layer using one gets its own copy.
    shape_only = _shape_only(nodes)
    movable = {n for n in nodes if level.get(n) is None or (n in shape_only and n.op != "get_attr")}
    _place_input_only_nodes(gm, level, last, movable, {n for n in shape_only if _disposable(n)})
    gm.recompile()

    # Layers are the ranks that kept nodes, renumbered densely (a module reused later joins later layers).
    placed = cast(dict[fx.Node, int], level)  # _place_input_only_nodes placed every node
    used = sorted({k for k in placed.values()})
    dense = {k: i for i, k in enumerate(used)}
    by_rank = {r: u for u, r in rank.items()}
    names = [by_rank[k] for k in used]
    layer_of = {n: dense[k] for n, k in placed.items()}
    inputs = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    return LayerGraph(gm=gm, names=names, layer_of=layer_of, inputs=inputs)


def _shape_only(nodes: list[fx.Node]) -> set[fx.Node]:
    """Nodes whose value depends on no input's values, only on sizes and attributes, without effects (no
    in-place op, no module holding buffers: a BatchNorm would count its batches twice; no random numbers)."""
    out: set[fx.Node] = set()
    for n in nodes:
        if n.op == "get_attr" or is_size(n):
            out.add(n)
        elif n.op not in ("placeholder", "output") and all(a in out for a in n.all_input_nodes) \
                and not _has_effects(n):
            out.add(n)
    return out


def _disposable(n: fx.Node) -> bool:
    """A call that may go when nothing uses it: not a check of sizes (``_assert_scalar``: a sequence too long)."""
    name = str(getattr(n.target, "__name__", n.target))
    return n.op == "call_function" and (name.startswith("_assert_tensor_metadata")
                                        or not any(w in name for w in ("assert", "check", "constrain")))


_RANDOM = ("dropout", "rand", "bernoulli", "multinomial", "normal")  # a copy would draw other numbers
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _has_effects(n: fx.Node) -> bool:
    """Whether computing ``n`` again elsewhere would change what the model computes."""
    if n.op == "call_module":
        root = n.graph.owning_module
        if root is None:
            raise RuntimeError(f"{n.name}: its graph belongs to no GraphModule")
        module = root.get_submodule(cast(str, n.target))  # a call_module's target: the module's path
        return isinstance(module, _DROPOUTS) or any(True for _ in module.buffers())
    name = str(getattr(n.target, "__name__", n.target)).split(".")[0]  # aten: "add_.Tensor"
    return (name.endswith("_") and not name.endswith("__")) or any(w in name for w in _RANDOM)


def _place_input_only_nodes(gm: fx.GraphModule, level: dict[fx.Node, int | None], last: int,
                            movable: set[fx.Node], disposable: set[fx.Node]) -> None:
    """Place each unplaced node in its users' first layer, and give every later layer using a ``movable`` node
    its own copy (a placed one stays in its layer, and goes if nothing there uses it). A ``disposable`` node
    nothing uses (an assertion on a copied value's dtype) goes too."""
    graph = gm.graph
    for n in reversed(list(graph.nodes)):  # users come later, so they are placed before n is reached
        if n.op in ("placeholder", "output") or n not in movable:
            continue
        by_level: dict[int, list[fx.Node]] = {}
        for u in n.users:
            by_level.setdefault(last if u.op == "output" else cast(int, level[u]), []).append(u)  # users: placed
        if not by_level:
            if n in disposable:
                graph.erase_node(n)
                del level[n]
            elif level[n] is None:  # dead code: nothing uses it
                level[n] = 0
            continue
        home = level[n] if level[n] is not None else min(by_level)
        for k in sorted(by_level):
            if k == home:
                continue
            with graph.inserting_after(n):  # a copy per other layer, so the value never crosses a cut
                copy = graph.node_copy(n, lambda a: a)
            level[copy] = k
            for u in by_level[k]:
                u.replace_input_with(n, copy)
        level[n] = home
        if home not in by_level:  # an owned node whose every user got a copy
            graph.erase_node(n)
            del level[n]
