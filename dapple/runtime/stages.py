"""Splitting a traced model into stage submodules at a plan's cuts (torch.fx split_module), original names kept."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Sequence, cast

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module

from ..core.plan import Plan
from ..profiler.export_graph import retarget_devices
from ..profiler.layer_graph import LayerGraph
from ..profiler.layers import Arity, arity

# torch >= 2.12 can make every partition return a tuple; older ones return a lone value bare, which
# _with_original_names reads the same way
_TUPLE_RETURN: dict[str, Any] = \
    {"tuple_return": True} if "tuple_return" in inspect.signature(split_module).parameters else {}


@dataclass
class StageGraph:
    """One stage of the split model, as every rank sees it.

    ``module`` holds the stage's computation; its parameters and buffers keep their qualified names in the
    original model (``blocks.3.attn.qkv.weight``). Values are named after the nodes of the traced model.
    """

    index: int
    module: fx.GraphModule
    args: list[str]  # the module's positional inputs: model input names or boundary value names
    outs: list[str]  # what the module returns (a tuple), in order
    recv: list[str]  # boundary values arriving from stage index-1 (including ones relayed onwards)
    send: list[str]  # boundary values leaving for stage index+1 (including relayed ones)
    output: Any = None  # last stage: the model's output structure, value names in place of nodes
    inputs: list[str] = field(default_factory=list)  # the model inputs this stage reads locally
    modified: set[str] = field(default_factory=set)  # received values the stage changes in place

    def parameters(self) -> list[nn.Parameter]:
        """This stage's parameters, each once, in module order."""
        return list(self.module.parameters())


@dataclass(frozen=True)
class ModelInputs:
    """The traced model's inputs, as every stage sees them."""

    names: list[str]  # placeholder names, in forward's order
    defaults: dict[str, Any]  # name -> default of the inputs that have one (``forward(x, mask=None)``: mask)
    arity: Arity  # how many positional inputs a call must give


def model_inputs(gm: fx.GraphModule) -> ModelInputs:
    """The inputs of traced ``gm``: names, defaults and arity."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return ModelInputs([n.name for n in placeholders], {n.name: n.args[0] for n in placeholders if n.args},
                       arity(gm))


def stage_module(graph: StageGraph, traced: fx.GraphModule, device: torch.device) -> nn.Module:
    """The stage's module moved to ``device``; a torch.export graph also gets the traced device baked in and its
    factory ops (``arange(..., device=)``) pointed at ``device``."""
    module = graph.module.to(device)
    if "dapple_trace" in traced.meta and isinstance(module, fx.GraphModule):  # torch.export graphs
        module.meta["dapple_trace"] = dict(traced.meta["dapple_trace"])
        retarget_devices(module, device)
    return module


class RankStages(nn.Module):
    """The chunks a rank holds, as one module (``stage3``, ``stage4``, ...): its parameters (a tied one once), state
    dict and train/eval mode are all of theirs. Each chunk still runs as its own module."""

    def __init__(self, modules: Sequence[nn.Module], stages: Sequence[int]):
        super().__init__()
        for s, m in zip(stages, modules):
            self.add_module(f"stage{s}", m)


def rank_module(modules: Sequence[nn.Module], stages: Sequence[int]) -> nn.Module:
    """What a rank holds: its one stage's module itself, or its chunks' in a :class:`RankStages`."""
    return modules[0] if len(modules) == 1 else RankStages(modules, stages)


def cuts_of(stage_layers: Sequence[tuple[int, int]]) -> list[int]:
    """Layer index where each stage starts."""
    return [lo for lo, _ in stage_layers]


def boundary_values(lg: LayerGraph, stage_of: dict[fx.Node, int], num_stages: int) -> list[list[str]]:
    """carry[c]: values computed in stages <= c and used in a stage > c (or by the model output), in graph order.

    A value made in stage i and used in stage j > i+1 (a long skip) appears in every cut between: it is
    relayed through the middle stages, which keeps its gradient path (each relay backpropagates it as an
    identity).
    """
    last_use: dict[fx.Node, int] = {}
    for n in lg.gm.graph.nodes:
        user_stage = num_stages - 1 if n.op == "output" else stage_of.get(n)
        if user_stage is None:
            continue
        for a in n.all_input_nodes:
            if a.op not in ("placeholder", "get_attr"):
                last_use[a] = max(last_use.get(a, -1), user_stage)
    carry: list[list[str]] = [[] for _ in range(num_stages - 1)]
    for n in lg.gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output") or n not in stage_of:
            continue
        for c in range(stage_of[n], last_use.get(n, -1)):
            carry[c].append(n.name)
    return carry


def split_stages(lg: LayerGraph, stage_layers: Sequence[tuple[int, int]]) -> list[StageGraph]:
    """Cut ``lg`` into one :class:`StageGraph` per stage (layer ranges ``[start, end)``, contiguous)."""
    num_stages = len(stage_layers)
    stage_of = lg.stage_of_node(cuts_of(stage_layers))
    qualnames: dict[str, str] = {}
    # keep_original_order=False: the parent graph calls the stages in dependency order. A later stage's first
    # node may precede an earlier stage's in the graph (GPT's position ids, layer wpe, come before wte).
    parts = split_module(lg.gm, lg.gm, lambda n: stage_of[n], qualname_map=qualnames, keep_original_order=False,
                         keep_original_node_name=True, **_TUPLE_RETURN)
    original = {n.name: n for n in lg.gm.graph.nodes}
    carry = boundary_values(lg, stage_of, num_stages)
    model_inputs = [n.name for n in lg.gm.graph.nodes if n.op == "placeholder"]
    stages = []
    for s in range(num_stages):
        name = f"submod_{s}"
        sub = getattr(parts, name, None)
        if sub is None:  # a stage whose layers hold no computation at all
            raise ValueError(f"stage {s} (layers {list(stage_layers[s])}) contains no operations to run")
        graph, args, outs = _with_original_names(sub.graph, name, qualnames, original)
        module = fx.GraphModule(lg.gm, graph, f"Stage{s}")  # copies referenced submodules under their paths
        stage = StageGraph(index=s, module=module, args=args, outs=outs,
                           recv=carry[s - 1] if s > 0 else [], send=carry[s] if s < num_stages - 1 else [],
                           inputs=[a for a in args if a in model_inputs], modified=modified_in_place(module))
        stages.append(stage)
    out_node = next(n for n in lg.gm.graph.nodes if n.op == "output")
    stages[-1].output = fx.node.map_arg(out_node.args[0], lambda n: _Ref(n.name))
    return stages


def modified_in_place(gm: fx.GraphModule) -> set[str]:
    """Placeholders that an op changes in place (``relu_``, ``x.add_``, ``nn.ReLU(inplace=True)``).

    Received values become autograd leaves, which may not be modified in place; the engine hands
    these ones to the stage through a copy.
    """
    out = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" or not n.args or not isinstance(n.args[0], fx.Node) or n.args[0].op != "placeholder":
            continue
        name = getattr(n.target, "__name__", str(n.target))
        inplace = n.kwargs.get("inplace", False) is True or (name.endswith("_") and not name.endswith("__"))
        if n.op == "call_module":
            inplace = getattr(gm.get_submodule(n.target), "inplace", False) is True
        if inplace:
            out.add(n.args[0].name)
    return out


class _Ref(str):
    """A value name standing in for an fx node inside the model's output structure."""


def resolve_output(template: Any, env: dict[str, Any]) -> Any:
    """The model output structure with each value name replaced by its value from ``env``."""
    if isinstance(template, _Ref):
        return env[template]
    if isinstance(template, tuple):
        return tuple(resolve_output(t, env) for t in template)
    if isinstance(template, list):
        return [resolve_output(t, env) for t in template]
    if isinstance(template, dict):
        return {k: resolve_output(v, env) for k, v in template.items()}
    return template


def _with_original_names(sub: fx.Graph, prefix: str, qualnames: dict[str, str], original: dict[str, fx.Node]
                         ) -> tuple[fx.Graph, list[str], list[str]]:
    """Rebuild a split_module partition graph so it addresses the original model's attributes.

    split_module renames call_module targets ``a.b`` -> ``a_b`` (undone via ``qualname_map``) and turns
    get_attr tensors (parameters used directly) into placeholders (turned back into get_attr nodes here).
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    args: list[str] = []
    outs: list[str] = []
    for n in sub.nodes:
        if n.op == "placeholder":
            orig = original.get(n.name)
            if orig is not None and orig.op == "get_attr":
                env[n] = graph.get_attr(cast(str, orig.target))  # (a get_attr's target: the attribute's name)
            else:
                env[n] = graph.placeholder(n.name)
                args.append(n.name)
        elif n.op in ("call_module", "get_attr"):
            target = qualnames.get(f"{prefix}.{n.target}", n.target)
            new = graph.create_node(n.op, target, fx.node.map_arg(n.args, env.__getitem__),
                                    fx.node.map_arg(n.kwargs, env.__getitem__), name=n.name)
            new.meta = dict(n.meta)
            env[n] = new
        elif n.op == "output":
            values = n.args[0]
            values = values if isinstance(values, (tuple, list)) else (values,)
            outs = [v.name for v in values]
            graph.output(tuple(env[v] for v in values))
        else:
            env[n] = graph.node_copy(n, env.__getitem__)
    graph.lint()
    return graph, args, outs


def layer_paths(model: nn.Module, plan: Plan, layers: Sequence[str] | None) -> Sequence[str] | None:
    """The modules to make layers of: ``layers`` if given; else the plan's layer names where they are module paths
    of ``model`` (the profile's layers, whatever rule made them); else None (the default rule)."""
    if layers is not None or plan.layer_names is None:
        return layers
    modules = dict(model.named_modules())
    names = list(plan.layer_names)
    nested = len(set(names)) < len(names) or any(b.startswith(a + ".") for a in names for b in names)
    return names if names and all(n and n in modules for n in names) and not nested else None


def node_places(lg: LayerGraph, stage_layers: Sequence[tuple[int, int]]) -> dict[str, tuple[str, int]]:
    """Node name -> (its layer's name, its stage) under stages of layer ranges ``stage_layers``."""
    stage_of = lg.stage_of_node(cuts_of(stage_layers))
    return {n.name: (lg.names[k], stage_of[n]) for n, k in lg.layer_of.items()}
