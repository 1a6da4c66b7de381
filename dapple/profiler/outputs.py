"""A traced model's output in the model's own structure (a ``ModelOutput``, a dataclass): one node rebuilds it."""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch.utils import _pytree as pytree


class RebuildOutput:
    """``rebuild(*leaves)`` -> the model's output structure (``pytree.tree_unflatten`` with the traced spec).

    The target of the graph's last call node, so that the graph (and the last layer or stage cut from it) returns
    what the model returns, and a loss function gets it unchanged; fx code calls it as a global by its name.
    """

    def __init__(self, spec: pytree.TreeSpec):
        self.spec = spec
        self.__name__ = "rebuild_output"  # what the generated code calls it
        self.__module__ = __name__

    def __call__(self, *leaves: Any) -> Any:
        return pytree.tree_unflatten(list(leaves), self.spec)

    def __repr__(self) -> str:
        return f"RebuildOutput({self.spec})"


def is_output_structure(n: fx.Node) -> bool:
    """Whether ``n`` rebuilds the model's output structure (it belongs in the last layer)."""
    return n.op == "call_function" and isinstance(n.target, RebuildOutput)


def rebuild_output(graph: fx.Graph, leaves: list[Any], spec: pytree.TreeSpec) -> fx.Node:
    """Make the graph return ``tree_unflatten(leaves, spec)`` through one node, added before the output."""
    out = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(out):
        node = graph.call_function(RebuildOutput(spec), tuple(leaves))
    out.args = (node,)
    return node
