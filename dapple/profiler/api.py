"""``dapple.profile``: trace a model into layers and measure each one's times and sizes at a few batch sizes."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from ..core.checks import flag, is_int
from ..core.meta import InitFn, check_init_fn, is_meta_model
from ..core.profile import LayerProfile, Profile
from .batch import Batch, as_tensors, check_batch_sizes, common_batch_size, resize, to_model
from .boundary import crossing_shapes, cut_problems
from .by_name import by_position, keyword_tensors
from .export_graph import retarget_devices
from .fx_trace import LeafSpec
from .layer_graph import LayerGraph
from .layers import arity, trace_layers
from .measure import LayerMeasurement, LayerTimer, call_timer, time_rounds, time_selective, time_weight_shares
from .meta_measure import Measured, measure_meta
from .record import layer_module, record_inputs
from .sizes import state_storages, tensor_bytes
from .state import model_dtype, on_device, resolve_device, untouched
from .trace_options import record

WEIGHT_RUNS = 3  # split backward runs per layer and batch size, after the rounds, for its weight-gradient share


def profile(model: nn.Module, example_inputs: Batch, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
            batch_sizes: int | tuple[int, ...] | list[int] | None = None, *, targets: Batch | None = None,
            repeats: int = 10, warmup: int = 3, device: str | torch.device | None = None,
            concrete_args: dict[str, Any] | None = None, leaf_modules: LeafSpec = (), name: str | None = None,
            progress: bool | None = None, check_step: bool = False, tracer: str = "auto",
            dynamic_shapes: Any = None, layers: Sequence[str] | None = None,
            init_fn: InitFn | None = None, selective: bool = False) -> Profile:
    """Measure every layer of ``model`` (forward/backward ms, boundary/saved/param bytes) at each batch size.

    Layers are timed on their own, from inputs recorded in one run of the whole model per batch size, in rounds
    that run every layer at every batch size (a burst of load spreads over all of them); times are medians. The
    model is profiled in training mode in its own dtype; its device, flags, buffers, gradients and RNG are kept.

    A model on the meta device is profiled one layer at a time, each made real on ``device`` (``init_fn``), run on
    the real outputs of the layers before it, timed and freed; a repeated block takes its first copy's times
    (``meta["reused"]``). Sizes are the real model's.

    Args:
        model: the module to profile.
        example_inputs: its inputs at any batch size: a tensor or tuple of tensors (positional), or tensors by
            name (a dict, a ``BatchEncoding``: passed to ``forward`` by keyword, the model's only inputs, e.g.
            ``{"input_ids": ids, "attention_mask": mask}``); rows along dim 0 are taken or repeated to make each
            batch size. Their shapes and dtypes are recorded (``meta["tracing"]``, with the tracer and its
            options), and a plan made from the profile carries them to :func:`dapple.pipeline`.
        loss_fn: ``loss_fn(model_output, *targets)`` (the runtime's convention), made part of the last layer
            (forward and backward); it gets the output as the model returns it (a tensor, tuple, dict or
            ``ModelOutput``); None: backward starts from a gradient of ones on every output.
        batch_sizes: the batch sizes to measure (default: half the example's and the example's).
        targets: the loss's targets, at the batch size of ``example_inputs`` (required with ``loss_fn``).
        repeats: timed runs of each layer per batch size (after ``warmup`` untimed ones).
        warmup: untimed runs of each layer per batch size.
        device: where to profile (default: cuda if available, else cpu); the model is moved there and back.
        concrete_args: Python-level arguments fixed for the tracer (see :class:`~dapple.profiler.TraceError`);
            ``use_cache=False`` is added where ``forward`` takes ``use_cache``.
        leaf_modules: module classes or qualified names torch.fx keeps as opaque calls.
        name: the profile's model name (default: the model's class name).
        progress: a progress bar over layers (None: only when stderr is a terminal).
        selective: also measure what selective recomputation keeps and adds per layer (``selective_bytes``,
            ``selective_ms``, which ``recompute="selective"`` is priced from; profiling takes about a third longer).
        check_step: also time whole-model steps in the same rounds, into ``meta["step_ms"]``,
            ``meta["layers_over_step"]`` (the layers' forward + backward summed, over a whole step; 1.0 when they
            add up exactly) and ``meta["stage_over_step"]`` (the same for what the cost model charges the model
            as one stage: the layers less ``call_ms``, and ``call_ms`` once).
        tracer: ``"fx"``, ``"export"`` (torch.export from ``example_inputs``, batch dim dynamic) or ``"auto"``
            (fx, torch.export where fx fails); see :func:`~dapple.profiler.trace_layers`.
        dynamic_shapes: torch.export's dynamic dims per input (dim 0 is always dynamic).
        layers: module paths that each become a layer, instead of the default (every block of the model's stacks
            of repeated blocks, at whatever depth, and the modules beside them); see
            :func:`~dapple.profiler.trace_layers`. The rule is recorded in ``meta["layering"]``, and a plan
            made from the profile names the layers, which ``dapple.pipeline`` then uses.
        init_fn: for a meta-device model, ``init_fn(module)`` on each module holding a tensor of the layer made
            real, as for :func:`dapple.pipeline` (None: ``reset_parameters()``, or a transformers model's
            ``_init_weights``); what it leaves unset gets small random values (the times do not depend on them).

    Returns:
        The :class:`~dapple.Profile`. Its ``call_ms`` is an empty layer's forward and backward, timed in the same
        rounds: what each layer's times include for being called at all, which a stage pays once.
    """
    _check_options(model, loss_fn, targets, repeats, warmup, check_step, init_fn)
    flag("selective", selective, "measure selective recomputation")
    on_meta = is_meta_model(model)
    by_name = keyword_tensors(example_inputs, "example_inputs")  # inputs by keyword: in the traced order below
    inputs = as_tensors(example_inputs, "example_inputs") if by_name is None else ()
    target_list = as_tensors(targets, "targets") if targets is not None else ()
    dev = resolve_device(device)
    lg = _traced(model, inputs, by_name, concrete_args=concrete_args, leaf_modules=leaf_modules, tracer=tracer,
                 dynamic_shapes=dynamic_shapes, layers=layers)  # errors before any work
    if by_name is not None:
        inputs = by_position(by_name, lg.inputs, "example_inputs", gaps=False)
    arity(lg.gm).check(len(inputs), "example_inputs")
    named = {f"example_inputs[{i}] ({lg.inputs[i]})": t for i, t in enumerate(inputs)}
    named.update({f"targets[{i}]" if len(target_list) > 1 else "targets": t for i, t in enumerate(target_list)})
    example = common_batch_size(named)
    sizes = check_batch_sizes(batch_sizes, example)

    started = time.perf_counter()
    dtype = model_dtype(model)
    bar = tqdm(total=len(sizes) * (lg.num_layers + 1) * (1 + warmup + repeats), unit="layer", leave=False,
               desc=f"profiling {name or type(model).__name__}",
               disable=not (sys.stderr.isatty() if progress is None else progress))
    try:
        job = _Job(model, lg, inputs, target_list, sizes, loss_fn, dev, dtype, warmup, repeats, bar, selective)
        runs = _measure_meta(job, init_fn) if on_meta else _measure(job, check_step)
    finally:
        bar.close()
    call_ms = [round(statistics.median([x for t in runs.calls for x in getattr(t.result, key)]) * 1e3, 6)
               for key in ("forward_s", "backward_s")]
    uncut = cut_problems(lg, dict(zip(sizes, runs.crossing)))  # per layer: why no plan may cut after it
    meta = {"dtype": str(dtype).removeprefix("torch."), "repeats": repeats, "warmup": warmup,
            "loss": getattr(loss_fn, "__name__", type(loss_fn).__name__) if loss_fn is not None else None,
            "example_batch_size": example, "threads": torch.get_num_threads(), "torch": str(torch.__version__),
            "profiling_seconds": round(time.perf_counter() - started, 3),
            **_how_traced(lg, inputs, by_name is not None, concrete_args, leaf_modules, dynamic_shapes, uncut)}
    if on_meta:  # which layers took an identical earlier layer's times
        meta.update(materialised="one layer at a time", reused=runs.reused)
    prof = Profile(model=name or type(model).__name__, device=str(dev), batch_sizes=sizes,
                   layers=_layer_profiles(lg, runs, uncut, selective), meta=meta, call_ms=call_ms)
    if check_step:  # the yardstick: a whole-model step, timed in the same rounds as the layers
        meta.update(_step_ratios(prof, runs.steps))
    return prof


def _traced(model: nn.Module, inputs: tuple[torch.Tensor, ...], by_name: dict[str, torch.Tensor] | None,
            **options: Any) -> LayerGraph:
    """``model`` traced into layers (trace_layers' ``options``) on its example inputs, cast to its dtype as torch.export
    traces them (by name where given so)."""
    dtype = model_dtype(model)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return to_model(t, t.device, dtype)
    example = {k: cast(t) for k, t in by_name.items()} if by_name else tuple(map(cast, inputs))
    return trace_layers(model, example_inputs=example, **options)


def _how_traced(lg: LayerGraph, inputs: tuple[torch.Tensor, ...], by_name: bool, concrete_args: Any,
                leaf_modules: LeafSpec, dynamic_shapes: Any, uncut: list[str | None]) -> dict[str, Any]:
    """The profile's meta on tracing: the tracer, the layering rule, what a plan carries to dapple.pipeline
    (``tracing``: the tracer, its options and the example's shapes) and the boundaries no plan may cut."""
    meta = {"tracer": lg.gm.meta.get("dapple_trace", {}).get("method", "fx"),
            "layering": lg.layering.to_meta() if lg.layering is not None else None,
            "tracing": record(lg, inputs, by_name, concrete_args, leaf_modules, dynamic_shapes).to_dict()}
    if any(uncut):
        meta["uncuttable"] = {lg.names[k]: why for k, why in enumerate(uncut) if why}
    return meta


def _check_options(model: Any, loss_fn: Any, targets: Any, repeats: Any, warmup: Any, check_step: Any,
                   init_fn: Any) -> None:
    """Errors naming the argument, before anything is traced."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    check_init_fn(init_fn)
    if check_step and is_meta_model(model):
        raise ValueError("check_step=True times whole-model steps, which a meta-device model cannot run; profile "
                         "it without check_step (its layers are timed one at a time)")
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


@dataclass(frozen=True)
class _Job:
    """What profile() measures, and how: the model, its layers, the example batch, the timing rounds."""

    model: nn.Module
    lg: LayerGraph
    inputs: tuple[torch.Tensor, ...]
    targets: tuple[torch.Tensor, ...]
    sizes: list[int]
    loss_fn: Callable | None
    dev: torch.device
    dtype: torch.dtype
    warmup: int
    repeats: int
    bar: Any  # tqdm
    selective: bool = False  # also measure selective recomputation


def _measure(job: _Job, check_step: bool) -> Measured:
    """Record every batch size's layer inputs, then time all layers in interleaved rounds, on ``job.dev``."""
    model, lg, inputs, targets, loss_fn = job.model, job.lg, job.inputs, job.targets, job.loss_fn
    dev, dtype, warmup, repeats, bar = job.dev, job.dtype, job.warmup, job.repeats, job.bar
    out = Measured([], [], [], [], [])
    with on_device(model, dev), untouched(model, dev):
        lg.gm.to(dev)  # tensor constants fx lifted into the traced module
        retarget_devices(lg.gm, dev)  # torch.export graphs: arange(..., device=<traced on>)
        layers = [layer_module(lg, k) for k in range(lg.num_layers)]
        state = state_storages([model, lg.gm])
        groups, wholes, layer_timers = [], [], []
        for b in job.sizes:  # recorded inputs of every batch size stay alive: the rounds interleave them
            x = tuple(to_model(resize(t, b), dev, dtype) for t in inputs)
            ys = tuple(to_model(resize(t, b), dev, dtype) for t in targets)
            values = record_inputs(lg, layers, x)
            out.boundary.append([sum(tensor_bytes(values[n]) for n in lg.crossing(k)) for k in range(lg.num_layers)])
            out.crossing.append(crossing_shapes(lg, values))
            timers = [LayerTimer(lm, values, loss_fn=loss_fn, targets=ys, state=state, device=dev,
                                 selective=job.selective) for lm in layers]
            out.layers.append([t.measure_sizes() for t in timers])
            out.calls.append(call_timer(dev, dtype, state))
            bar.update(len(timers) + 1)
            groups.append(timers + [out.calls[-1]])
            layer_timers.append(timers)
            wholes.append((model, x, ys, loss_fn))
            del values
        out.steps.extend(time_rounds(groups, warmup, repeats, bar, wholes=wholes if check_step else None,
                                     device=dev))
        time_weight_shares(layer_timers, WEIGHT_RUNS if repeats >= WEIGHT_RUNS else repeats)
        if job.selective:
            time_selective(layer_timers, WEIGHT_RUNS if repeats >= WEIGHT_RUNS else repeats)
        del groups, wholes, layer_timers
    return out


def _measure_meta(job: _Job, init_fn: InitFn | None) -> Measured:
    """A meta-device model: every layer profiled on ``job.dev`` on its own, made real and freed in turn."""
    dev, dtype, repeats = job.dev, job.dtype, job.repeats
    with untouched(job.model, dev):
        retarget_devices(job.lg.gm, dev)  # torch.export graphs: arange(..., device=<traced on>)
        xs = [tuple(to_model(resize(t, b), dev, dtype) for t in job.inputs) for b in job.sizes]
        ys = [tuple(to_model(resize(t, b), dev, dtype) for t in job.targets) for b in job.sizes]
        return measure_meta(job.model, job.lg, xs, ys, loss_fn=job.loss_fn, dev=dev, dtype=dtype, warmup=job.warmup,
                            repeats=repeats, weight_runs=WEIGHT_RUNS if repeats >= WEIGHT_RUNS else repeats,
                            init_fn=init_fn, bar=job.bar, selective=job.selective)


def _layer_profiles(lg: LayerGraph, runs: Measured, uncut: list[str | None], selective: bool) -> list[LayerProfile]:
    """One LayerProfile per layer: its medians, bytes and inputs at every batch size, whether a plan may cut after
    it (``uncut``: why not, or None), and with ``selective`` what selective recomputation keeps and adds."""
    saved = [_saved_once(lg, measured) for measured in runs.layers]
    params = lg.params_by_layer()
    return [LayerProfile(name=layer_name,
                         forward_ms=[round(m[k].forward_ms, 6) for m in runs.layers],
                         backward_ms=[round(m[k].backward_ms, 6) for m in runs.layers],
                         boundary_bytes=[bb[k] for bb in runs.boundary], saved_bytes=[s[k] for s in saved],
                         param_bytes=sum(p.numel() * p.element_size() for _, p in params[k]),
                         inputs=lg.layer_inputs(k),
                         weight_ms=[round(m[k].backward_ms * m[k].weight_share, 6) for m in runs.layers],
                         selective_bytes=[m[k].kept_bytes for m in runs.layers] if selective else None,
                         selective_ms=[round(m[k].selective_ms, 6) for m in runs.layers] if selective else None,
                         cuttable=uncut[k] is None)
            for k, layer_name in enumerate(lg.names)]


def _step_ratios(prof: Profile, steps: list[float]) -> dict[str, list[float]]:
    """``step_ms``, ``layers_over_step`` and ``stage_over_step`` (see :func:`profile`'s ``check_step``)."""
    return {
        "step_ms": [round(s * 1e3, 6) for s in steps],
        "layers_over_step": [round(sum(layer.forward_ms[i] + layer.backward_ms[i] for layer in prof.layers)
                                   / (s * 1e3), 4) for i, s in enumerate(steps)],
        # what the cost model charges the whole model as one stage: each layer less the call, the call once
        "stage_over_step": [round((sum(prof.call_ms) + sum(map(sum, prof.net_ms(b)))) / (s * 1e3), 4)
                            for b, s in zip(prof.batch_sizes, steps)],
    }


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
