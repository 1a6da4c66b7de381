"""A traced model whose nodes are grouped into layers: the units a plan cuts between."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from .units import Layering


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
    layering: Layering | None = None  # how the layers were chosen (trace_layers sets it)

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def nodes(self, layer: int) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if self.layer_of.get(n) == layer]

    def stage_of_node(self, cuts: list[int]) -> dict[fx.Node, int]:
        """Map each node to its stage for stage boundaries ``cuts`` (layer index where each stage starts)."""
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
