"""PipeDream's antichain DAG (graph/graph.py of msr-fiddle/pipedream): the states its planner cuts between."""

from __future__ import annotations

from dataclasses import dataclass

# Port of the parts of graph/graph.py (msr-fiddle/pipedream, commit 11c40c0) that
# optimizer/optimizer_graph_hierarchical.py uses: sources/sinks/remove_node, predecessors/successors,
# augment_antichain, deaugment_augmented_antichain, next_antichains, antichain_dag, topological_sort.
# Nodes are ints (our layer indices, a topological order), so predecessor/successor sets are int bitmasks.
# Where PipeDream iterates a Python set (the extra nodes of an augmented antichain), we iterate in node
# order instead, so the result is deterministic (PipeDream's depends on string hashing there, which only
# matters when the antichain DAG branches).


def _bits(mask: int):
    """Indices of the set bits of ``mask``, ascending."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


@dataclass
class State:
    """An antichain-DAG node (graph.py's AntichainNode) with the sums main() attaches to it."""

    antichain: list[int]  # the *augmented* antichain (graph.py stores augment_antichain(...))
    predecessors: int  # bitmask of all_predecessors(antichain): every node at or before this cut
    output_activation_size: float = 0.0  # bytes: sum of activation_size over the augmented antichain
    compute_time: float = 0.0  # seconds: sum of (forward + backward) ms / 1000 over `predecessors`
    activation_size: float = 0.0  # bytes: sum of activation_size over `predecessors`
    parameter_size: float = 0.0  # bytes: sum of parameter_size over `predecessors`


class Graph:
    """graph.Graph restricted to what the optimizer needs; node ids 0..n-1 are in topological order."""

    def __init__(self, descs: list[str], edges: list[tuple[int, int]]):
        self.descs = descs
        self.nodes: dict[int, str] = dict(enumerate(descs))  # insertion order = PipeDream's file order
        self.edges: dict[int, list[int]] = {}
        self.in_edges: dict[int, list[int]] = {}
        for a, b in edges:
            self.edges.setdefault(a, []).append(b)
            self.in_edges.setdefault(b, []).append(a)
        self._pred: list[int] | None = None
        self._succ: list[int] | None = None
        self._augmented: dict[tuple, list[int]] = {}
        self._next: dict[tuple, list[list[int]]] = {}

    # ---- graph.py: sources / sinks / remove_node -------------------------------------------
    def sources(self) -> list[int]:
        return [v for v in self.nodes if not self.in_edges.get(v)]

    def sinks(self) -> list[int]:
        return [v for v in self.nodes if not self.edges.get(v)]

    def remove_node(self, v: int) -> None:
        del self.nodes[v]
        for w in self.edges.pop(v, []):
            self.in_edges[w].remove(v)
        for u in self.in_edges.pop(v, []):
            self.edges[u].remove(v)
        self._pred = self._succ = None

    # ---- transitive predecessors / successors (graph.py: predecessors, successors) ---------
    def _masks(self) -> None:
        n = len(self.descs)
        pred, succ = [0] * n, [0] * n
        for v in sorted(self.nodes):  # ids are a topological order
            for u in self.in_edges.get(v, []):
                pred[v] |= (1 << u) | pred[u]
        for v in sorted(self.nodes, reverse=True):
            for w in self.edges.get(v, []):
                succ[v] |= (1 << w) | succ[w]
        self._pred, self._succ = pred, succ

    def pred(self, v: int) -> int:
        if self._pred is None:
            self._masks()
        return self._pred[v]  # type: ignore[index]

    def succ(self, v: int) -> int:
        if self._succ is None:
            self._masks()
        return self._succ[v]  # type: ignore[index]

    def all_predecessors(self, antichain: list[int]) -> int:
        mask = 0
        for v in antichain:
            mask |= self.pred(v) | (1 << v)
        return mask

    # ---- antichains ------------------------------------------------------------------------
    def augment_antichain(self, antichain: list[int]) -> list[int]:
        # graph.py augment_antichain: add the predecessors whose output is still read beyond the cut
        key = tuple(sorted(antichain))
        if key not in self._augmented:
            extra: set[int] = set()
            for a in antichain:
                p = self.pred(a)
                for q in _bits(p):
                    if any(not (p >> w) & 1 and w != a for w in self.edges.get(q, [])):
                        extra.add(q)
            self._augmented[key] = sorted(extra) + list(antichain)
        return self._augmented[key]

    def deaugment(self, augmented: list[int]) -> list[int]:
        # graph.py deaugment_augmented_antichain: drop nodes that have a successor in the set
        remove = {v for v in augmented if any((self.succ(v) >> w) & 1 for w in augmented)}
        out: list[int] = []
        for v in augmented:
            if v not in remove and v not in out:
                out.append(v)
        return out

    def next_antichains(self, antichain: list[int]) -> list[list[int]]:
        # graph.py next_antichains: advance one node of the augmented antichain to a successor
        key = tuple(sorted(antichain))
        if key not in self._next:
            nxt = []
            members = set(antichain)
            augmented = self.augment_antichain(antichain)
            for a in augmented:
                for w in self.edges.get(a, []):
                    if w in members:
                        continue
                    if not any((self.succ(w) >> x) & 1 for x in augmented):  # is_next_antichain
                        nxt.append(self.deaugment([w if x == a else x for x in augmented]))  # construct_antichain
            self._next[key] = nxt
        return self._next[key]

    def antichain_dag(self, max_states: int | None = None) -> tuple[list[list[int]], list[list[int]]]:
        """graph.py antichain_dag: BFS from [sources()[0]]; returns (augmented antichains, out-edges) by node id.

        Raises ValueError past ``max_states`` states (wide graphs have exponentially many antichains)."""
        start = [self.sources()[0]]
        antichains = [self.augment_antichain(start)]
        out: list[list[int]] = [[]]
        ids = {tuple(sorted(start)): 0}
        queue = [start]
        while queue:
            antichain = queue.pop(0)
            key = tuple(sorted(antichain))
            if key in self._next:  # already expanded
                continue
            for nxt in self.next_antichains(antichain):
                nkey = tuple(sorted(nxt))
                if nkey not in ids:
                    if max_states is not None and len(antichains) >= max_states:
                        raise ValueError(f"pipedream_plan: the graph has more than {max_states} antichain states "
                                         f"(PipeDream's planner enumerates every antichain of a wide graph and its "
                                         f"DP is cubic in their number); raise max_states to plan it anyway")
                    ids[nkey] = len(antichains)
                    antichains.append(self.augment_antichain(nxt))
                    out.append([])
                out[ids[key]].append(ids[nkey])
                queue.append(nxt)
        return antichains, out


def topological_sort(out: list[list[int]]) -> list[int]:
    """graph.py topological_sort on the antichain DAG: reverse DFS post-order, nodes and out-edges in
    insertion order (its sort keys, node_desc and height, are equal for all antichain nodes)."""
    marked = [False] * len(out)
    order: list[int] = []
    for root in range(len(out)):
        if marked[root]:
            continue
        stack = [(root, iter(out[root]))]
        marked[root] = True
        while stack:
            v, it = stack[-1]
            for w in it:
                if not marked[w]:
                    marked[w] = True
                    stack.append((w, iter(out[w])))
                    break
            else:
                stack.pop()
                order.append(v)
    order.reverse()
    return order


def build_states(graph: Graph, compute_ms: list[float], activation: list[float], params: list[float],
                 max_states: int | None = None) -> tuple[list[State], list[list[int]]]:
    """main() of optimizer_graph_hierarchical.py up to the DP: states in topological order with their sums,
    and all_predecessor_ids (every antichain-DAG ancestor of each state, ascending)."""
    antichains, out = graph.antichain_dag(max_states)
    order = topological_sort(out)
    index = {v: i for i, v in enumerate(order)}
    states = []
    for v in order:
        aug = antichains[v]
        mask = graph.all_predecessors(aug)
        members = list(_bits(mask))
        states.append(State(
            antichain=aug, predecessors=mask,
            output_activation_size=sum(activation[x] for x in aug),
            compute_time=sum(compute_ms[x] / 1000.0 for x in members),
            activation_size=sum(activation[x] for x in members),
            parameter_size=sum(params[x] for x in members)))
    # antichain_gr.predecessors(...) is transitive; PipeDream iterates it as a set, we ascend by state index
    anc = [0] * len(out)
    for v in order:
        for w in out[v]:
            anc[w] |= anc[v] | (1 << v)
    return states, [sorted(index[u] for u in _bits(anc[v])) for v in order]
