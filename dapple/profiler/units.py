"""Which modules become layers: the repeated blocks wherever they sit, and what lies between them, or given paths."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from torch import nn

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
OTHER_STACKS = 4  # a second stack of blocks counts when it holds at least 1/4 of the largest one's parameters


@dataclass(frozen=True)
class Layering:
    """How a model's modules were chosen as layers (recorded in a Profile's ``meta["layering"]``).

    ``rule`` is ``"blocks"`` (the default: every block of the stacks in ``blocks`` is a layer, and the modules
    around them at the same depth) or ``"given"`` (``units`` are the module paths the caller gave).
    """

    rule: str
    units: tuple[str, ...]  # candidate layer paths; those that run no operation drop out of the layers
    blocks: tuple[str, ...] = ()  # rule "blocks": the containers whose children are the blocks

    def to_meta(self) -> dict[str, Any]:
        if self.rule == "given":
            return {"rule": "given", "layers": list(self.units)}
        return {"rule": "blocks", "blocks": list(self.blocks)}


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _stack_weight(container: nn.Module) -> int:
    """Parameters held by the children of a container's most frequent class if it repeats, or of any child of a
    ModuleList/ModuleDict (a list of one block is still a list of blocks); else 0."""
    kids = list(container.children())
    if not kids:
        return 0
    kind, count = Counter(type(k) for k in kids).most_common(1)[0]
    listed = isinstance(container, (nn.ModuleList, nn.ModuleDict))
    return sum(_numel(k) for k in kids if type(k) is kind) if count >= 2 or listed else 0


def _nested(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def find_blocks(model: nn.Module) -> list[str]:
    """The containers (ModuleList/Sequential/ModuleDict below the model itself) holding the repeated blocks.

    A container is a stack when a class repeats among its children, or when it is a ModuleList/ModuleDict; it
    weighs the parameters of the children of its most frequent class.
    The heaviest stack is chosen, then every other one, not nested in a chosen one, of at least 1/OTHER_STACKS of
    its weight (an encoder's and a decoder's blocks). In module order.
    """
    stacks = [(w, path) for path, m in model.named_modules()
              if path and isinstance(m, CONTAINERS) and (w := _stack_weight(m)) > 0]
    if not stacks:
        return []
    heaviest = max(w for w, _ in stacks)
    chosen: list[str] = []
    for w, path in sorted(stacks, key=lambda s: (-s[0], s[1].count("."))):  # (stable: module order on ties)
        if w * OTHER_STACKS >= heaviest and not any(_nested(path, c) for c in chosen):
            chosen.append(path)
    order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    return sorted(chosen, key=order.__getitem__)


def _expand(module: nn.Module, prefix: str, blocks: Sequence[str]) -> list[str]:
    """Candidate layers under ``module``: the blocks of a stack, the modules around the path down to one, and
    elsewhere each child (a container: each of its children)."""
    units: list[str] = []
    for name, child in module.named_children():
        path = prefix + name
        if any(b.startswith(path + ".") for b in blocks):  # on the way down to a stack
            units.extend(_expand(child, path + ".", blocks))
        elif path in blocks or (isinstance(child, CONTAINERS) and len(child) > 0):
            units.extend(f"{path}.{sub}" for sub, _ in child.named_children())
        else:
            units.append(path)
    return units


def layering(model: nn.Module, layers: Sequence[str] | None = None) -> Layering:
    """The layers of ``model``: the given module paths, or by default the blocks of its stacks (``find_blocks``)
    and, at each depth down to them, the modules beside them; containers elsewhere are expanded one level, so a
    model whose blocks are top-level containers gets its top-level children with containers expanded.

    Args:
        model: the model.
        layers: module paths (``model.get_submodule`` names) that each become a layer, overriding the default;
            operations of no listed module join a neighbouring layer.
    """
    if layers is not None:
        return Layering("given", tuple(check_layer_paths(model, layers)))
    blocks = find_blocks(model)
    return Layering("blocks", tuple(_expand(model, "", blocks)), tuple(blocks))


def check_layer_paths(model: nn.Module, layers: Any) -> list[str]:
    """``layers`` as a list of distinct, non-nested module paths of ``model``; errors name the bad value."""
    if isinstance(layers, str) or not isinstance(layers, (list, tuple)) or not layers:
        raise TypeError(f"layers: expected a non-empty list of module paths (e.g. ['embed', 'blocks.0', "
                        f"'blocks.1', 'head']), got {layers!r:.100}")
    modules = dict(model.named_modules())
    for path in layers:
        if not isinstance(path, str) or not path or path not in modules:
            near = [p for p in modules if p and isinstance(path, str) and p.startswith(path.rpartition(".")[0])]
            raise ValueError(f"layers: {path!r} is not a submodule of {type(model).__name__} (module paths as "
                             f"named_modules() gives them, e.g. {near[:4] or list(modules)[1:5]})")
    for i, a in enumerate(layers):
        for b in layers[i + 1:]:
            if _nested(a, b):
                raise ValueError(f"layers: {a!r} and {b!r} overlap (one is the other or inside it); each operation "
                                 f"must belong to one layer")
    return list(layers)
