"""Exported graphs made fit for dapple: module paths, tied names, bodies, views, devices, layer-local sizes."""

from __future__ import annotations

import os
import re
import sys
import warnings
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from .layer_graph import LayerGraph

if TYPE_CHECKING:
    from types import FrameType


def user_stacklevel() -> int:
    """``stacklevel`` for ``warnings.warn`` called by the caller of this function: the first frame outside dapple,
    so a warning points at the user's code rather than at dapple's internals."""
    here, level = os.path.dirname(os.path.dirname(__file__)), 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(here):
        level, frame = level + 1, frame.f_back
    return level


def is_dynamic_size(size: Any) -> TypeGuard[torch.SymInt]:
    """Whether ``size`` (a dim of an exported tensor's shape) stayed symbolic: a SymInt whose expression is not a
    plain number (one that is was specialised by export)."""
    return isinstance(size, torch.SymInt) and not size.node.expr.is_number


_GETATTR = re.compile(r"getattr\(([^()]*), ['\"]([^'\"]+)['\"]\)")  # dynamo: getattr(L['self'].blocks, '0')
_ITEM = re.compile(r"(?:\._modules)?\[['\"]?([^'\"\]]+)['\"]?\]")  # ._modules['0'], ['x'], [0]
_ROOT = re.compile(r"^(L\[['\"]self['\"]\]|L__self__|self)(?=$|[.\[])")


def module_path(path: str) -> str:
    """A module path as export/dynamo spell it (``L['self'].blocks[0]``, ``blocks.0``) -> ``blocks.0``."""
    p = path.strip()
    while (q := _GETATTR.sub(r"\1.\2", p)) != p:
        p = q
    p = _ROOT.sub("", p)
    p = _ITEM.sub(r".\1", p)
    return p.strip(".")


def clean_module_stacks(gm: fx.GraphModule) -> None:
    """Rewrite every node's ``nn_module_stack`` in place: values as (dotted path, type), and export's placeholder
    entries for stackless nodes dropped, so layers.py finds each node's module as for an fx graph."""
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        if not stack:
            continue
        clean = {}
        for key, value in stack.items():
            if key.startswith("_empty_nn_module_stack"):
                continue
            path, kind = value if isinstance(value, tuple) else (key, "")
            clean[key] = (module_path(path), kind)
        n.meta["nn_module_stack"] = clean


def canonical_get_attrs(gm: fx.GraphModule, model: nn.Module) -> None:
    """Rename each get_attr target to the first name its tensor has in ``model`` (a tied weight: ``wte.weight``)
    and remove unused get_attr nodes, in place."""
    first: dict[int, str] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        first.setdefault(id(t), name)
    tensors: dict[str, torch.Tensor] = dict(gm.named_parameters(remove_duplicate=False))
    tensors.update(gm.named_buffers(remove_duplicate=False))
    for n in list(gm.graph.nodes):
        if n.op != "get_attr":
            continue
        if not n.users:
            gm.graph.erase_node(n)
            continue
        tensor = tensors.get(n.target)
        if tensor is None:  # a submodule (higher-order op body) or a constant
            continue
        first_name = first.get(id(tensor))
        if first_name is not None and first_name != n.target and _has_tensor(gm, first_name, tensor):
            n.target = first_name


def _has_tensor(gm: fx.GraphModule, name: str, t: torch.Tensor) -> bool:
    """Whether ``gm`` holds ``t`` under ``name`` (export keeps every alias of a tied parameter)."""
    module_name, _, attr = name.rpartition(".")
    try:
        return getattr(gm.get_submodule(module_name), attr, None) is t
    except AttributeError:
        return False


def rename_export_bodies(gm: fx.GraphModule) -> None:
    """Move higher-order op bodies (no_grad/autocast regions), which export calls ``submod_<i>`` like split_module's
    own partitions, to ``_export_body_<i>``, in place."""
    for n in gm.graph.nodes:
        if n.op == "get_attr" and re.fullmatch(r"submod_\d+", n.target) and \
                isinstance(getattr(gm, n.target, None), nn.Module):
            new = "_export_body_" + n.target.removeprefix("submod_")
            gm.add_submodule(new, getattr(gm, n.target))
            delattr(gm, n.target)
            n.target = new


def views_as_reshapes(gm: fx.GraphModule) -> int:
    """``aten.view`` -> ``aten.reshape``: the same view wherever the view works, a copy where it would fail.

    Export drops ``.contiguous()`` where it was a no-op on the tracing device (CPU attention returns a layout in
    which ``y.transpose(1, 2)`` is already contiguous), so ``y.transpose(1, 2).contiguous().view(B, T, C)``
    becomes a bare view that fails for another kernel's layout (meta device, CUDA). Returns how many changed.
    """
    views = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.view.default]
    for n in views:
        n.target = torch.ops.aten.reshape.default
    return len(views)


def retarget_devices(gm: fx.GraphModule, device: str | torch.device) -> int:
    """Point factory ops and copies traced on one device (``arange(..., device='cpu')``, ``x.to('cpu')``) at
    ``device``; returns how many.

    Export bakes the tracing device into ops that create tensors; fx graphs (no recorded device) are left alone.
    """
    traced = gm.meta.get("dapple_trace", {}).get("device")
    device = torch.device(device)
    changed = 0
    for n in gm.graph.nodes:
        if traced is None:
            break
        if isinstance(n.kwargs.get("device"), torch.device) and n.kwargs["device"] == traced:
            n.update_kwarg("device", device)
            changed += 1
        for i, a in enumerate(n.args):  # aten.to.device(x, device, dtype)
            if isinstance(a, torch.device) and a == traced:
                n.update_arg(i, device)
                changed += 1
    if changed:
        gm.meta["dapple_trace"]["device"] = device
        gm.recompile()
    return changed


def _is_size_of_input(n: fx.Node, layer_of: dict[fx.Node, int]) -> bool:
    """A size read off a model input or off a value of an earlier layer than the size's own."""
    if n.op != "call_function" or n.target is not torch.ops.aten.sym_size.int or not isinstance(n.args[0], fx.Node):
        return False
    t = n.args[0]
    return t.op == "placeholder" or (t in layer_of and n in layer_of and layer_of[t] < layer_of[n])


def localise_sizes(lg: LayerGraph) -> int:
    """Read each input size a layer uses off a tensor the layer already has; returns how many were moved.

    ``sym_size(idx, 0)`` copied into ``blocks.3`` becomes ``sym_size(x, 0)`` with ``x`` the block's input
    (same symbol, so the same value for every input export accepts): the stage then needs no model input, nor
    an earlier layer's value it would otherwise read only for a size.
    """
    graph = lg.gm.graph
    order: dict[fx.Node, float] = {n: i for i, n in enumerate(graph.nodes)}
    members: dict[int, list[fx.Node]] = {}
    for n in graph.nodes:
        if n in lg.layer_of:
            members.setdefault(lg.layer_of[n], []).append(n)
    moved = 0
    for s in [n for n in graph.nodes if _is_size_of_input(n, lg.layer_of)]:
        k = lg.layer_of.get(s)
        if k is None or not s.users or any(u.op == "output" or lg.layer_of.get(u) != k for u in s.users):
            continue
        if any(lg.layer_of.get(u) == k and not _is_size_of_input(u, lg.layer_of) for u in s.args[0].users):
            continue  # the layer reads the input anyway
        user = min(s.users, key=order.__getitem__)
        anchor = _anchor(members[k], lg.layer_of, k, s, order, order[user])
        if anchor is None:
            continue
        with graph.inserting_before(user):
            new = graph.call_function(torch.ops.aten.sym_size.int, anchor)
        new.meta = {**s.meta, "val": anchor[0].meta["val"].shape[anchor[1]]}
        order[new], lg.layer_of[new] = order[user] - 0.5, k
        s.replace_all_uses_with(new)
        graph.erase_node(s)
        del lg.layer_of[s]
        moved += 1
    if moved:
        lg.gm.recompile()
    return moved


def _anchor(own: list[fx.Node], layer_of: dict[fx.Node, int], k: int, s: fx.Node, order: dict[fx.Node, float],
            before: float) -> tuple[fx.Node, int] | None:
    """(tensor, dim): a tensor that layer ``k`` reads from earlier layers (other than for size ``s``) or makes,
    before position ``before``, whose dim ``dim`` is the symbolic size ``s`` reads; None if there is none."""
    size = s.meta.get("val")
    if not is_dynamic_size(size):
        return None
    inputs = [a for n in own if n is not s for a in n.all_input_nodes if layer_of.get(a, k) < k and order[a] < before]
    for t in inputs + [n for n in own if order[n] < before]:
        val = t.meta.get("val")
        if isinstance(val, torch.Tensor):
            for d, dim_size in enumerate(val.shape):
                if is_dynamic_size(dim_size) and dim_size.node.expr == size.node.expr:
                    return t, d
    return None


def check_cuts(lg: LayerGraph) -> None:
    """Warn about non-tensor values (symbolic ints) crossing a cut: a stage would have to send a Python int."""
    bad = sorted({n.name for k in range(lg.num_layers - 1) for n in lg.crossing(k)
                  if "val" in n.meta and not all(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(n.meta["val"]))
                  })
    if bad:
        warnings.warn(f"non-tensor values cross layer cuts in the exported graph: {bad}; no plan can cut where they "
                      "cross (the profile marks those boundaries; compute sizes from tensors inside the layer that "
                      "uses them)", stacklevel=user_stacklevel())
