"""Profiling a meta-device model one layer at a time: each layer is made real on the profiling device (random
init), run on the real outputs of the layers before it, timed, and freed; identical repeated blocks are timed once.

At any moment the device holds one layer (parameters and gradients) and the values that cross the layer boundary
being profiled, at every batch size: the model itself never needs to fit.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from ..core.meta import InitFn, default_init, materialise, release, replace
from .boundary import shape_of
from .layer_graph import LayerGraph
from .measure import LayerMeasurement, LayerTimer, call_timer, time_rounds, time_selective, time_weight_shares
from .record import LayerModule, fresh, layer_module
from .sizes import state_storages, tensor_bytes


class Measured(NamedTuple):
    """What the rounds measured, per batch size (the profiler's result, whichever way the model was run)."""

    layers: list[list[LayerMeasurement]]  # per batch size, per layer
    boundary: list[list[int]]  # per batch size, per layer: bytes a cut after the layer carries
    crossing: list[list[dict]]  # per batch size, per layer but the last: the shape of each value a cut there carries
    calls: list[LayerTimer]  # per batch size: the empty layer (Profile.call_ms)
    steps: list[float]  # per batch size: a whole step's median seconds (check_step; else empty)
    reused: dict[str, str] | None = None  # layer -> the identical earlier layer whose times it took (meta models)


def _keep(t: Any) -> Any:
    """A private copy of a layer's output for the layers after it, remembering requires_grad."""
    return t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, Tensor) else t


def _spec(v: Any) -> Any:
    return tree_map(lambda t: (tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, Tensor) else t, v)


def structure(lm: LayerModule, name: str, values: list[dict[fx.Node, Any]]) -> tuple:
    """What makes two layers time alike: their operations (module paths relative to the layer), parameter and
    buffer shapes and dtypes, and the shapes of what they read at every batch size."""
    index = {n: i for i, n in enumerate(lm.gm.graph.nodes)}

    def arg(a: Any) -> Any:
        return ("node", index[a]) if isinstance(a, fx.Node) else repr(a)

    ops = []
    for n in lm.gm.graph.nodes:
        target = n.target.replace(name, "", 1) if isinstance(n.target, str) else getattr(n.target, "__name__", n.target)
        target = "" if n.op == "placeholder" else target  # named after the value it reads
        module = lm.gm.get_submodule(n.target) if n.op == "call_module" else None
        kind = f"{type(module).__name__}({module.extra_repr()})" if module is not None else ""
        ops.append((n.op, str(target), kind, str(fx.node.map_aggregate(n.args, arg)),
                    str(fx.node.map_aggregate(n.kwargs, arg))))
    state = [(tuple(t.shape), t.dtype) for t in [*lm.gm.parameters(), *lm.gm.buffers()]]
    reads = [[_spec(v[a]) for a in lm.inputs] for v in values]
    return tuple(ops), tuple(state), str(reads), lm.is_last


def measure_meta(model: nn.Module, lg: LayerGraph, inputs: list[tuple[Tensor, ...]], targets: list[tuple], *,
                 loss_fn: Callable | None, dev: torch.device, dtype: torch.dtype, warmup: int, repeats: int,
                 weight_runs: int, init_fn: InitFn | None, bar: Any, selective: bool = False) -> Measured:
    """Profile every layer of meta-device ``model`` (traced as ``lg``) at each batch size's ``inputs`` and
    ``targets`` (on ``dev``), one layer on the device at a time.

    A layer whose :func:`structure` equals an earlier one's (a repeated block) is run once per batch size, for
    its outputs and saved bytes, and takes the earlier layer's times; ``reused`` records which.
    """
    init = init_fn or default_init(model)
    layers = [layer_module(lg, k) for k in range(lg.num_layers)]
    holders = [model, lg.gm, *(lm.gm for lm in layers)]
    last_read = {a: k for k, lm in enumerate(layers) for a in lm.inputs}
    values: list[dict[fx.Node, Any]] = [{n: x for n, x in zip(_placeholders(lg.gm), xs)} for xs in inputs]
    calls = [call_timer(dev, dtype, set()) for _ in inputs]
    reused: dict[str, str] = {}  # out.reused
    out = Measured([[] for _ in inputs], [[] for _ in inputs], [[] for _ in inputs], calls, [], reused)
    timed: dict[tuple, tuple[str, list[LayerMeasurement]]] = {}
    for k, lm in enumerate(layers):
        done, moved = _make_real(model, lm, holders, dev, init, lg.names[k])
        try:
            key = structure(lm, lg.names[k], values)
            timers = [LayerTimer(lm, v, loss_fn=loss_fn, targets=ys, state=state_storages([lm.gm]), device=dev,
                                 selective=selective) for v, ys in zip(values, targets)]
            measured = [t.measure_sizes() for t in timers]
            if key in timed:  # a repeated block: the first one's times
                reused[lg.names[k]], first = timed[key]
                _take_times(measured, first)
                bar.update(len(timers) * (warmup + repeats))
            else:
                timed[key] = (lg.names[k], measured)
                time_rounds([[t, c] for t, c in zip(timers, calls)], warmup, repeats, bar, wholes=None, device=dev)
                time_weight_shares([[t] for t in timers], weight_runs)
                if selective:
                    time_selective([[t] for t in timers], weight_runs)
            for b, (v, m) in enumerate(zip(values, measured)):
                out.layers[b].append(m)
                if not lm.is_last:
                    v.update(_outputs(lm, v))
                out.boundary[b].append(sum(tensor_bytes(v[n]) for n in lg.crossing(k)))
                if not lm.is_last:
                    out.crossing[b].append({n.name: shape_of(v[n]) for n in lg.crossing(k) if n in v})
                for n in [n for n in v if last_read.get(n, -1) <= k and n not in lg.crossing(k)]:
                    del v[n]  # read by no later layer
            del timers
        finally:
            release(done, holders)
            replace(holders, moved)
        bar.update(len(inputs))
    return out


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _make_real(model: nn.Module, lm: LayerModule, holders: list[nn.Module], dev: torch.device, init: InitFn,
               name: str) -> tuple[Any, dict[int, Tensor]]:
    """Layer ``lm``'s meta tensors made real on ``dev`` (random init), its real ones elsewhere moved there; returns
    what :func:`release` and :func:`replace` undo afterwards."""
    own = [*lm.gm.parameters(), *lm.gm.buffers()]
    far = {id(t): t for t in own if not t.is_meta and t.device != dev}
    moved_to = {i: (nn.Parameter(t.to(dev), t.requires_grad) if isinstance(t, nn.Parameter) else t.to(dev))
                for i, t in far.items()}
    replace(holders, moved_to)
    done = materialise(model, own, holders, dev, init, where=f"dapple.profile, layer {name!r}", fill=True)
    return done, {id(moved_to[i]): t for i, t in far.items()}


def _outputs(lm: LayerModule, values: dict[fx.Node, Any]) -> dict[fx.Node, Any]:
    """Run layer ``lm`` forward once (autograd on, as in training) and keep copies of what later layers read."""
    with torch.enable_grad():
        result = lm.gm(*[tree_map(fresh, values[a]) for a in lm.inputs])
    return {n: tree_map(_keep, r) for n, r in zip(lm.outputs, result)}


def _take_times(measured: list[LayerMeasurement], first: list[LayerMeasurement]) -> None:
    """Give each batch size's measurement the times of the identical layer measured first."""
    for m, f in zip(measured, first):
        m.forward_s, m.backward_s = list(f.forward_s), list(f.backward_s)
        m.weight_s, m.split_s = list(f.weight_s), list(f.split_s)
        m.selective_s, m.plain_s = list(f.selective_s), list(f.plain_s)
