"""One GraphModule per layer, and a recording run of the whole model that captures every layer's inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import Tensor
from torch.utils._pytree import tree_map

from .layer_graph import LayerGraph


@dataclass
class LayerModule:
    """Layer ``index`` of a LayerGraph as a module of its own: ``gm(*values of inputs)`` -> outputs.

    For every layer but the last, ``gm`` returns a tuple aligned with ``outputs`` (the layer's nodes read by
    later layers or by the model's output). The last layer returns the model's output, in the model's own
    structure, so a loss function can be applied to it.
    """

    index: int
    gm: fx.GraphModule
    inputs: list[fx.Node]  # nodes of the full graph this layer reads: placeholders or nodes of earlier layers
    outputs: list[fx.Node]
    is_last: bool


def layer_module(lg: LayerGraph, k: int) -> LayerModule:
    """Copy the nodes of layer ``k`` into a graph of their own (sharing the model's submodules and parameters)."""
    own = lg.nodes(k)
    members = set(own)
    is_last = k == lg.num_layers - 1
    out_node = next(n for n in reversed(lg.gm.graph.nodes) if n.op == "output")
    readers = own + [out_node] if is_last else own
    inputs: list[fx.Node] = []
    for n in readers:
        for a in n.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {a: graph.placeholder(a.name) for a in inputs}
    for n in own:
        env[n] = graph.node_copy(n, lambda a: env[a])
    if is_last:
        outputs = [a for a in out_node.all_input_nodes if a in members]
        graph.output(fx.map_arg(out_node.args[0], lambda a: env[a]))
    else:
        outputs = [n for n in own if any(u.op == "output" or lg.layer_of[u] != k for u in n.users)]
        graph.output(tuple(env[n] for n in outputs))
    gm = fx.GraphModule(lg.gm, graph, class_name=f"Layer{k}")
    return LayerModule(index=k, gm=gm, inputs=inputs, outputs=outputs, is_last=is_last)


def _keep(t: Any) -> Any:
    """A private copy of a recorded value (later in-place ops cannot change it) that remembers requires_grad."""
    if isinstance(t, Tensor):
        return t.detach().clone().requires_grad_(t.requires_grad)
    return t


def fresh(t: Any) -> Any:
    """A new copy of a recorded value for one run; one that requires grad is a non-leaf, so in-place ops work."""
    if not isinstance(t, Tensor):
        return t
    if t.requires_grad:
        return t.detach().requires_grad_().clone()  # backward flows into the throwaway leaf, like into a sender
    return t.clone()


class NodeRecorder(fx.Interpreter):
    """Runs the graph, keeping the values of the nodes in ``keep`` (each passed through ``transform``)."""

    def __init__(self, gm: fx.GraphModule, keep: set[fx.Node], transform: Callable[[Any], Any] | None = _keep):
        super().__init__(gm)
        self.keep = keep
        self.transform = transform
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n in self.keep:
            self.values[n] = out if self.transform is None else tree_map(self.transform, out)
        return out


def record_inputs(lg: LayerGraph, layers: list[LayerModule], inputs: tuple[Tensor, ...]) -> dict[fx.Node, Any]:
    """Run the whole model once (with autograd on, as in training) and keep every value a layer reads.

    Returns node -> value (detached copies; tensors keep the requires_grad they had in the model).
    """
    keep = {a for lm in layers for a in lm.inputs}
    rec = NodeRecorder(lg.gm, keep)
    with torch.enable_grad():
        rec.run(*inputs)
    return rec.values
