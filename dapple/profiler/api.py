"""``dapple.profile``: trace a model into layers and measure each one's times and sizes at a few batch sizes."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from ..core.checks import is_int
from ..core.profile import LayerProfile, Profile
from .batch import Batch, as_tensors, check_batch_sizes, common_batch_size, resize, to_model
from .export_graph import retarget_devices
from .fx_trace import LeafSpec
from .layers import LayerGraph, arity, trace_layers
from .measure import LayerMeasurement, LayerTimer, call_timer, time_rounds
from .record import layer_module, record_inputs
from .sizes import state_storages, tensor_bytes
from .state import model_dtype, on_device, resolve_device, untouched


def profile(model: nn.Module, example_inputs: Batch, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
            batch_sizes: int | tuple[int, ...] | list[int] | None = None, *, targets: Batch | None = None,
            repeats: int = 10, warmup: int = 3, device: str | torch.device | None = None,
            concrete_args: dict[str, Any] | None = None, leaf_modules: LeafSpec = (), name: str | None = None,
            progress: bool | None = None, check_step: bool = False, tracer: str = "auto",
            dynamic_shapes: Any = None) -> Profile:
    """Measure every layer of ``model`` (forward/backward ms, boundary/saved/param bytes) at each batch size.

    ``example_inputs``: the model's positional inputs (a tensor or tuple of tensors) at any batch size; rows
    along dim 0 are taken or repeated to make each of ``batch_sizes`` (default: half the example's and the
    example's). With ``loss_fn``, ``loss_fn(model_output, *targets)`` (the runtime's convention) is part of the last layer (forward and
    backward), and ``targets`` (same batch size as the inputs) are required; without it, backward starts from a
    gradient of ones on every output. Times are medians of ``repeats`` runs after ``warmup`` runs of each layer
    on its own, from inputs recorded in one run of the whole model (per batch size; all are held at once, as
    each round runs every layer at every batch size, so a burst of load spreads over all of them); the model is profiled in training mode on
    ``device`` (default: cuda if available, else cpu; the model is moved there and back) in its own dtype,
    and its flags, buffers (BatchNorm statistics), gradients and the RNG are left as they were.
    ``concrete_args`` / ``leaf_modules`` go to torch.fx (see :class:`~dapple.profiler.TraceError`). ``tracer``:
    ``"fx"``, ``"export"`` (torch.export from ``example_inputs``, batch dim dynamic, other dims per
    ``dynamic_shapes``) or ``"auto"`` (fx, torch.export where fx fails); see :func:`~dapple.profiler.trace_layers`.
    ``progress``: a progress bar over layers (None: only when stderr is a terminal). ``check_step``: also time
    whole-model steps in the same rounds, into ``meta["step_ms"]``, ``meta["layers_over_step"]`` (the sum of
    the layers' forward + backward over a whole step; 1.0 when the layers add up exactly) and
    ``meta["stage_over_step"]`` (the same for what the cost model charges the model as one stage: the layers less
    ``call_ms``, and ``call_ms`` once). ``Profile.call_ms``: an empty layer's forward and backward, timed in the
    same rounds: what each layer's times include for being called at all, which a stage pays once.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    for key, value, least in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if not is_int(value, least):
            raise ValueError(f"{key}: expected an integer >= {least}, got {value!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable loss_fn(output, *targets), got {type(loss_fn).__name__}")
    if loss_fn is not None and targets is None:
        raise ValueError("loss_fn was given without targets: pass targets=... (same batch size as example_inputs) "
                         "so the loss can be computed, or drop loss_fn to backpropagate ones from the output")
    if loss_fn is None and targets is not None:
        raise ValueError("targets were given without a loss_fn: pass loss_fn=... (called as loss_fn(output, "
                         "*targets)), or drop targets")
    inputs = as_tensors(example_inputs, "example_inputs")
    target_list = as_tensors(targets, "targets") if targets is not None else ()
    dev = resolve_device(device)

    cast = tuple(to_model(t, t.device, model_dtype(model)) for t in inputs)  # torch.export traces with these
    lg = trace_layers(model, concrete_args=concrete_args, leaf_modules=leaf_modules, method=tracer,
                      example_inputs=cast, dynamic_shapes=dynamic_shapes)  # TraceError before any work
    arity(lg.gm).check(len(inputs), "example_inputs")
    named = {f"example_inputs[{i}] ({lg.inputs[i]})": t for i, t in enumerate(inputs)}
    named.update({f"targets[{i}]" if len(target_list) > 1 else "targets": t for i, t in enumerate(target_list)})
    example = common_batch_size(named)
    sizes = check_batch_sizes(batch_sizes, example)

    started = time.perf_counter()
    dtype = model_dtype(model)
    per_batch: list[list[LayerMeasurement]] = []
    boundary: list[list[int]] = []
    with on_device(model, dev), untouched(model, dev):
        lg.gm.to(dev)  # tensor constants fx lifted into the traced module
        retarget_devices(lg.gm, dev)  # torch.export graphs: arange(..., device=<traced on>)
        layers = [layer_module(lg, k) for k in range(lg.num_layers)]
        state = state_storages([model, lg.gm])
        show = sys.stderr.isatty() if progress is None else progress
        bar = tqdm(total=len(sizes) * (lg.num_layers + 1) * (1 + warmup + repeats), unit="layer", leave=False,
                   desc=f"profiling {name or type(model).__name__}", disable=not show)
        try:
            groups, wholes, calls = [], [], []  # calls: an empty layer per batch size (Profile.call_ms)
            for b in sizes:  # recorded inputs of every batch size stay alive: the rounds interleave them
                x = tuple(to_model(resize(t, b), dev, dtype) for t in inputs)
                ys = tuple(to_model(resize(t, b), dev, dtype) for t in target_list)
                values = record_inputs(lg, layers, x)
                boundary.append([sum(tensor_bytes(values[n]) for n in lg.crossing(k))
                                 for k in range(lg.num_layers)])
                timers = [LayerTimer(lm, values, loss_fn=loss_fn, targets=ys, state=state, device=dev)
                          for lm in layers]
                per_batch.append([t.measure_sizes() for t in timers])
                calls.append(call_timer(dev, dtype, state))
                bar.update(len(timers) + 1)
                groups.append(timers + [calls[-1]])
                wholes.append((model, x, ys, loss_fn))
                del values
            steps = time_rounds(groups, warmup, repeats, bar, wholes=wholes if check_step else None, device=dev)
            del groups, wholes
        finally:
            bar.close()
    saved = [_saved_once(lg, measured) for measured in per_batch]
    call_ms = [round(statistics.median([x for t in calls for x in getattr(t.result, key)]) * 1e3, 6)
               for key in ("forward_s", "backward_s")]
    seconds = time.perf_counter() - started

    params = lg.params_by_layer()
    result = []
    for k, layer_name in enumerate(lg.names):
        result.append(LayerProfile(
            name=layer_name,
            forward_ms=[round(m[k].forward_ms, 6) for m in per_batch],
            backward_ms=[round(m[k].backward_ms, 6) for m in per_batch],
            boundary_bytes=[bb[k] for bb in boundary], saved_bytes=[s[k] for s in saved],
            param_bytes=sum(p.numel() * p.element_size() for _, p in params[k]),
            inputs=lg.layer_inputs(k)))
    meta = {"dtype": str(dtype).removeprefix("torch."), "repeats": repeats, "warmup": warmup,
            "loss": getattr(loss_fn, "__name__", type(loss_fn).__name__) if loss_fn is not None else None,
            "example_batch_size": example, "threads": torch.get_num_threads(), "torch": str(torch.__version__),
            "profiling_seconds": round(seconds, 3), "tracer": lg.gm.meta.get("dapple_trace", {}).get("method", "fx")}
    prof = Profile(model=name or type(model).__name__, device=str(dev), batch_sizes=sizes, layers=result,
                   meta=meta, call_ms=call_ms)
    if check_step:  # the yardstick: a whole-model step, timed in the same rounds as the layers
        meta["step_ms"] = [round(s * 1e3, 6) for s in steps]
        meta["layers_over_step"] = [
            round(sum(layer.forward_ms[i] + layer.backward_ms[i] for layer in result) / (s * 1e3), 4)
            for i, s in enumerate(steps)]
        # what the cost model charges the whole model as one stage: each layer less the call, the call once
        meta["stage_over_step"] = [round((sum(call_ms) + sum(map(sum, prof.net_ms(b)))) / (s * 1e3), 4)
                                   for b, s in zip(sizes, steps)]
    return prof


def _saved_once(lg: LayerGraph, measured: list[LayerMeasurement]) -> list[int]:
    """Saved bytes per layer, a tensor saved both by the layer that made it and by a reader counted at its maker.

    Summed over the layers of a stage this counts every saved tensor once (a reader in the next stage saves
    the copy it received, which this attributes to the sender: an undercount of at most one boundary there).
    """
    result = []
    for m in measured:
        shared = sum(b for node, b in m.saved_inputs.items()
                     if node in lg.layer_of and node in measured[lg.layer_of[node]].saved_outputs)
        result.append(m.saved_bytes - shared)
    return result
