"""What a cut between two layers carries: rows of the batch (split among replicas), or one tensor for every row
(sent whole to each replica), or something that can go neither way (the boundary cannot be cut)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from .layer_graph import LayerGraph

ROWS = "rows"  # dim 0 is the batch: each replica gets its rows
WHOLE = "whole"  # no batch dimension (a position bias from parameters and sizes): every replica gets all of it

Shape = tuple[int, ...] | None  # a value's shape; None: not a tensor


def is_size(n: fx.Node) -> bool:
    """A size query: ``aten.sym_size``, ``x.size(d)``, ``x.dim()``, ``x.shape``."""
    if n.op == "call_method":
        return n.target in ("size", "dim")
    if n.op != "call_function":
        return False
    if n.target is getattr:
        return len(n.args) > 1 and n.args[1] in ("shape", "ndim", "dtype", "device")
    return n.target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_size.default)


def data_dependent(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes whose value depends on the values of a model input, not only on sizes and parameters."""
    out: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":  # an input, unless a fixed Python value (use_cache=False, concrete_args)
            if not n.args or n.args[0] is None:
                out.add(n.name)
        elif n.op not in ("get_attr", "output") and not is_size(n) and any(a.name in out for a in n.all_input_nodes):
            out.add(n.name)
    return out


def value_kind(shapes: Mapping[int, Shape]) -> str | None:
    """ROWS if a value's dim 0 is the rows at every row count it was seen at (``shapes``: rows -> its shape); WHOLE
    if its shape is the same at every count (seen at one count only: if its dim 0 is not the rows); None (it cannot
    cross a cut) otherwise, or if it is not a tensor."""
    seen = list(shapes.values())
    if any(s is None for s in seen):
        return None
    if all(s is not None and len(s) > 0 and s[0] == rows for rows, s in shapes.items()):
        return ROWS
    if len(seen) > 1:
        return WHOLE if len(set(seen)) == 1 else None
    return WHOLE


def shape_of(value: Any) -> Shape:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def crossing_shapes(lg: LayerGraph, values: Mapping[fx.Node, Any]) -> list[dict[str, Shape]]:
    """Per layer but the last, the shape of each value a cut after it carries (``values``: node -> recorded value)."""
    return [{n.name: shape_of(values[n]) for n in lg.crossing(k) if n in values} for k in range(lg.num_layers - 1)]


def cut_problems(lg: LayerGraph, seen: Mapping[int, Sequence[Mapping[str, Shape]]]) -> list[str | None]:
    """Per layer, why a cut after it cannot run (None: it can): a value that is neither rows nor whole, or whole but
    computed from the batch's values (each replica's would differ). ``seen``: batch rows -> :func:`crossing_shapes`."""
    dependent = data_dependent(lg.gm)
    out: list[str | None] = [None] * lg.num_layers
    for k in range(lg.num_layers - 1):
        for name in next(iter(seen.values()))[k]:
            why = why_not(name, {rows: cuts[k].get(name) for rows, cuts in seen.items()}, dependent)
            out[k] = out[k] or (f"value {name!r}: {why}" if why else None)
    return out


def why_not(name: str, shapes: Mapping[int, Shape], dependent: set[str]) -> str | None:
    """Why value ``name`` (``shapes``: rows -> its shape) cannot cross a cut, or None if it can."""
    kind = value_kind(shapes)
    if any(s is None for s in shapes.values()):
        return "it is not a tensor"
    seen = " and ".join(f"{s} for {rows} rows" for rows, s in shapes.items())
    if kind is None:
        return f"its shape is {seen}: the batch rows are not in dimension 0"
    if kind == WHOLE and name in dependent:
        return (f"its shape is {seen}, without batch rows, but it is computed from the batch's values (each "
                f"replica's would differ)")
    return None
