"""A backward split in two (zero-bubble schedules): input gradients now (B), parameter gradients later (W)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class WeightGroup:
    """Seeds from which some parameters' gradients are computed in one call, without the input-gradient path.

    ``nodes`` are the graph nodes where the backward leaves the path to the stage's inputs toward these
    parameters (mixed nodes, e.g. a Linear's AddmmBackward); the B pass records what flowed into each (their
    gradient inputs). ``roots`` are outputs that reach these parameters but not the inputs, as (edge, index into
    the backward's roots); B gives them their gradients (``seeded``).
    """

    params: list[torch.Tensor]
    nodes: list[Node] = field(default_factory=list)
    roots: list[tuple[GradientEdge, int]] = field(default_factory=list)
    seeds: dict[int, tuple] = field(default_factory=dict)  # index into nodes -> its gradient inputs in B
    seeded: list[torch.Tensor] = field(default_factory=list)  # the roots' gradients, in ``roots`` order


@dataclass
class WeightWork:
    """What a micro-batch's W needs: the graph (kept alive by the roots) and the groups' seeds."""

    roots: list[torch.Tensor]
    groups: list[WeightGroup]


@dataclass
class BackwardPlan:
    """What B needs to know of a micro-batch's graph, found before its gradients arrive (:func:`plan_backward`)."""

    roots: list[torch.Tensor]
    inputs: list[torch.Tensor]
    groups: list[WeightGroup]
    reaches_inputs: bool  # some root leads to an input: B has input gradients to compute


def plan_backward(roots: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                  params: Sequence[torch.Tensor]) -> BackwardPlan:
    """Walk the graph under ``roots`` once: where it turns from the inputs' path toward ``params`` (the W seeds).

    Args:
        roots: tensors to backpropagate from (a stage's sent values, or its loss).
        inputs: tensors whose gradients B returns (the received values that require grad).
        params: the parameters whose gradients W accumulates into ``.grad``.
    """
    edges = [get_gradient_edge(r) for r in roots]
    leaf_nodes = {get_gradient_edge(x).node for x in inputs}
    param_of = {get_gradient_edge(p).node: p for p in params}
    graph = _Graph([e.node for e in edges], leaf_nodes, set(param_of))
    return BackwardPlan(list(roots), list(inputs), graph.weight_groups(edges, param_of),
                        bool(inputs) and any(e.node in graph.to_inputs for e in edges))


def run_backward_input(plan: BackwardPlan, grads: Sequence[torch.Tensor | None]
                       ) -> tuple[list[torch.Tensor | None], WeightWork]:
    """B of a planned backward: the gradients of ``plan.inputs`` (None where none flows) given the roots'
    gradients ``grads`` (None for a scalar loss: one), keeping what :func:`backward_weight` needs; no ``.grad``
    changes here."""
    for g in plan.groups:
        g.seeded = [gk if (gk := grads[k]) is not None else torch.ones_like(plan.roots[k]) for _, k in g.roots]
    handles = [n.register_prehook(_recorder(g, i)) for g in plan.groups for i, n in enumerate(g.nodes)]
    try:
        out: list[torch.Tensor | None] = [None] * len(plan.inputs)
        if plan.reaches_inputs:
            out = list(torch.autograd.grad(plan.roots, plan.inputs, list(grads), retain_graph=True,
                                           allow_unused=True))
    finally:
        for h in handles:
            h.remove()
    return out, WeightWork(plan.roots, plan.groups)


def backward_input(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
                   ) -> tuple[list[torch.Tensor | None], WeightWork]:
    """B: :func:`plan_backward` then :func:`run_backward_input`.

    Args:
        roots: tensors to backpropagate from (a stage's sent values, or its loss).
        grads: their gradients (None for a scalar loss: one).
        inputs: leaves whose gradients are returned (the received values that require grad).
        params: the parameters whose gradients :func:`backward_weight` accumulates into ``.grad`` later; no
            ``.grad`` changes here.
    """
    return run_backward_input(plan_backward(roots, inputs, params), grads)


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the parameter gradients into ``.grad`` (post-accumulate hooks fire as in a whole backward),
    one autograd call per group, starting from the seeds B recorded, so the input-gradient path is not run
    again (except between two seeds of one group, whose recorded gradients then replace what arrives)."""
    for g in work.groups:
        outs: list[GradientEdge] = [e for e, _ in g.roots]
        seeds: list[torch.Tensor] = list(g.seeded)
        for i, node in enumerate(g.nodes):
            for k, x in enumerate(g.seeds.get(i, ())):
                if x is not None:
                    outs.append(GradientEdge(node, k))
                    seeds.append(x)
        if not outs:
            continue
        clamps = [n.register_prehook(_replacer(g.seeds.get(i))) for i, n in enumerate(g.nodes)] \
            if len(g.nodes) > 1 else []
        try:
            torch.autograd.backward(outs, seeds, retain_graph=True, inputs=g.params)
        finally:
            for h in clamps:
                h.remove()
    work.groups.clear()


def _recorder(group: WeightGroup, i: int) -> Callable[[tuple], None]:
    """A node pre-hook that records the gradients flowing into ``group.nodes[i]`` (in B)."""
    def hook(grad_outputs: tuple) -> None:
        group.seeds[i] = tuple(grad_outputs)
    return hook


def _replacer(seed: tuple | None) -> Callable[[tuple], tuple]:
    """A node pre-hook that replaces what flows into the node (in W) by what B recorded there."""
    def hook(grad_outputs: tuple) -> tuple:
        return seed if seed is not None else tuple(None for _ in grad_outputs)
    return hook


class _Graph:
    """The autograd graph under some roots: which nodes lead to the inputs, which to the parameters."""

    def __init__(self, roots: list[Node], leaf_nodes: set[Node], param_nodes: set[Node]):
        self.children: dict[Node, list[Node]] = {}
        stack = [n for n in roots if n is not None]
        while stack:
            n = stack.pop()
            if n in self.children:
                continue
            kids = [c for c, _ in n.next_functions if c is not None]
            self.children[n] = kids
            stack += kids
        parents: dict[Node, list[Node]] = {n: [] for n in self.children}
        for n, kids in self.children.items():
            for c in kids:
                parents[c].append(n)
        self.to_inputs = _reaching(parents, leaf_nodes)
        self.to_params = _reaching(parents, param_nodes)

    def weight_groups(self, edges: list[GradientEdge], param_of: dict[Node, torch.Tensor]) -> list[WeightGroup]:
        """Mixed nodes and input-free roots, grouped so that no two groups reach a common node (each parameter
        then accumulates once per W, as the gradient AllReduce hooks expect)."""
        starts: list[tuple[Node, GradientEdge | None, int]] = []  # node, root edge (None: mixed), root index
        for n, kids in self.children.items():
            if n in self.to_inputs and any(c not in self.to_inputs and c in self.to_params for c in kids):
                starts.append((n, None, -1))
        for k, e in enumerate(edges):
            if e.node not in self.to_inputs and e.node in self.to_params:
                starts.append((e.node, e, k))
        owner: dict[Node, int] = {}
        parent = list(range(len(starts)))

        def find(a: int) -> int:
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a
        for s, (n, root, _) in enumerate(starts):
            stack = [c for c in self.children[n] if c not in self.to_inputs] if root is None else [n]
            while stack:
                c = stack.pop()
                if c not in self.to_params:
                    continue
                if c in owner:
                    parent[find(s)] = find(owner[c])
                    continue
                owner[c] = s
                stack += self.children[c]
        return _grouped(starts, owner, find, param_of)


def _grouped(starts: list[tuple[Node, GradientEdge | None, int]], owner: dict[Node, int],
             find: Callable[[int], int], param_of: dict[Node, torch.Tensor]) -> list[WeightGroup]:
    """One WeightGroup per set of starts that share a node, with the parameters they reach."""
    groups: dict[int, WeightGroup] = {}
    for s, (n, e, k) in enumerate(starts):
        grp = groups.setdefault(find(s), WeightGroup(params=[]))
        if e is None:
            grp.nodes.append(n)
        else:
            grp.roots.append((e, k))
    for node, s in owner.items():
        if node in param_of:
            groups[find(s)].params.append(param_of[node])
    return [g for g in groups.values() if g.params]


def _reaching(parents: dict[Node, list[Node]], targets: set[Node]) -> set[Node]:
    """The nodes from which some target is reachable (targets included), without recursion (deep graphs)."""
    seen = {t for t in targets if t in parents}
    stack = list(seen)
    while stack:
        n = stack.pop()
        for p in parents[n]:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen
