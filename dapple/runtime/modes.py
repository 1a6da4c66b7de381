"""Evaluation mode of a traced stage: the training flags its ops were traced with (dropout, batch norm) turned off."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.fx as fx
import torch.nn.functional as F

_aten = torch.ops.aten


class _Flag(NamedTuple):
    """Where an op takes its training flag, its default, and its value in evaluation."""

    position: int
    keyword: str
    default: Any
    off: Any = False


_FLAGS: dict[Any, _Flag] = {
    **{f: _Flag(2, "training", True) for f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d)},
    **{f: _Flag(2, "training", False) for f in (F.alpha_dropout, F.feature_alpha_dropout)},
    torch.dropout: _Flag(2, "train", None),
    F.batch_norm: _Flag(5, "training", False),
    F.scaled_dot_product_attention: _Flag(4, "dropout_p", 0.0, 0.0),
    **{op: _Flag(2, "train", None) for op in (_aten.dropout.default, _aten.native_dropout.default,
                                              _aten.feature_dropout.default, _aten.alpha_dropout.default,
                                              _aten.feature_alpha_dropout.default)},
    _aten.batch_norm.default: _Flag(5, "training", None),
    _aten._native_batch_norm_legit.default: _Flag(5, "training", None),
    _aten.scaled_dot_product_attention.default: _Flag(4, "dropout_p", 0.0, 0.0),
}


def _counts_batches(n: fx.Node) -> bool:
    """BatchNorm's ``num_batches_tracked += 1``, which a traced graph makes an op of its own in training."""
    target = n.args[0] if n.args else None
    return (n.op == "call_function" and n.target is _aten.add_.Tensor and isinstance(target, fx.Node)
            and target.op == "get_attr" and str(target.target).endswith("num_batches_tracked"))


def _turn_off(n: fx.Node, flag: _Flag) -> bool:
    """Set a node's training flag to its evaluation value; whether that changed the node."""
    if flag.keyword in n.kwargs:
        if n.kwargs[flag.keyword] == flag.off:
            return False
        n.update_kwarg(flag.keyword, flag.off)
    elif len(n.args) > flag.position:
        if n.args[flag.position] == flag.off:
            return False
        n.update_arg(flag.position, flag.off)
    elif flag.default == flag.off:
        return False
    else:
        n.update_kwarg(flag.keyword, flag.off)
    return True


def eval_graph(gm: fx.GraphModule) -> fx.GraphModule | None:
    """A twin of ``gm`` for evaluation, sharing its submodules, parameters and buffers, with the training flags
    of functional ops turned off (dropout, batch norm, attention dropout: torch.export and functional calls bake
    them in) and BatchNorm's batch counting dropped; None if ``gm`` has none (its modules' own ``.eval()`` is
    enough). Module calls (fx leaves: ``nn.Dropout``, ``nn.BatchNorm2d``) follow their modules' flags."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # node metadata shared, not copied (export's fake tensors)
    changed = False
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        if n.target in _FLAGS:
            changed |= _turn_off(n, _FLAGS[n.target])
        elif _counts_batches(n):
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
            changed = True
    if not changed:
        return None
    twin = fx.GraphModule(gm, graph, type(gm).__name__)
    twin.meta = dict(gm.meta)
    return twin
