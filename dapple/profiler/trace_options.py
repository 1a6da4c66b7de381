"""The tracer options a profile records (:class:`~dapple.core.trace_spec.TraceSpec`) and how ``dapple.pipeline``
traces a model as its plan says, with the caller's own options taking precedence."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.trace_spec import PLAIN, InputSpec, TraceSpec
from .fx_trace import LeafSpec
from .layer_graph import LayerGraph
from .state import model_dtype

CLASS = "class:"  # a leaf module given as a class: "class:module.QualName"
EXAMPLE_ROWS = 2  # rows of the example inputs rebuilt from a plan (torch.export traces dim 0 from 2 rows)


def record(lg: LayerGraph, inputs: tuple[torch.Tensor, ...], by_name: bool, concrete_args: dict[str, Any] | None,
           leaf_modules: LeafSpec, dynamic_shapes: Any) -> TraceSpec:
    """What traced ``lg`` (``inputs``: the example, in the traced model's order) and with which options."""
    given = dict(concrete_args or {})
    plain = {k: v for k, v in given.items() if isinstance(v, PLAIN)}
    unrecorded = (("concrete_args",) if len(plain) < len(given) else ()) + \
        (("dynamic_shapes",) if dynamic_shapes is not None else ())
    return TraceSpec(tracer=lg.gm.meta.get("dapple_trace", {}).get("method", "fx"),
                     inputs=tuple(InputSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                                  for name, t in zip(lg.inputs, inputs)),
                     by_name=by_name, concrete_args=plain, leaf_modules=tuple(_leaf_name(x) for x in leaf_modules),
                     unrecorded=unrecorded)


def _leaf_name(leaf: type | str) -> str:
    return f"{CLASS}{leaf.__module__}.{leaf.__qualname__}" if isinstance(leaf, type) else str(leaf)


def leaf_modules_of(spec: TraceSpec, model: nn.Module) -> list[type | str]:
    """The recorded leaf modules, classes looked up among ``model``'s modules (one it does not hold is dropped: no
    module of it to keep whole)."""
    classes = {_leaf_name(type(m)): type(m) for m in model.modules()}
    return [classes[x] if x.startswith(CLASS) else x for x in spec.leaf_modules if not x.startswith(CLASS)
            or x in classes]


def examples(spec: TraceSpec, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]:
    """Zeros of the recorded example inputs' shapes and dtypes, with :data:`EXAMPLE_ROWS` rows: what tracing needs
    (the values do not matter to it), by name where the profile gave them so; floating-point ones in ``dtype`` (the
    model's: the profiler traced them cast to its model's, and the traced graph checks the dtype)."""
    def zeros(i: InputSpec) -> torch.Tensor:
        t = torch.zeros((EXAMPLE_ROWS, *i.shape[1:]), dtype=getattr(torch, i.dtype))
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    made = {i.name: zeros(i) for i in spec.inputs}
    return made if spec.by_name else tuple(made.values())


def traced_as(spec: TraceSpec | None, model: nn.Module, *, tracer: str | None = None,
              concrete_args: dict[str, Any] | None = None, leaf_modules: LeafSpec | None = None,
              example_inputs: Any = None, dynamic_shapes: Any = None) -> dict[str, Any]:
    """``trace_layers``' tracing arguments: each one given, else the plan's recorded one (``spec``), else the
    default.

    Raises:
        ValueError: the profile was traced with options a plan cannot record (a ``concrete_args`` value that is no
            plain value, ``dynamic_shapes``) and the caller does not give them.
    """
    if spec is None:
        return dict(tracer=tracer or "auto", concrete_args=concrete_args, leaf_modules=leaf_modules or (),
                    example_inputs=example_inputs, dynamic_shapes=dynamic_shapes)
    lost = [k for k, given in (("concrete_args", concrete_args), ("dynamic_shapes", dynamic_shapes))
            if k in spec.unrecorded and given is None]
    if lost:
        raise ValueError(f"the profile behind this plan traced the model with {' and '.join(lost)} that a plan "
                         f"cannot record: pass {', '.join(f'{k}=...' for k in lost)} to dapple.pipeline, as to "
                         f"dapple.profile")
    return dict(tracer=tracer or spec.tracer,
                concrete_args=concrete_args if concrete_args is not None else dict(spec.concrete_args) or None,
                leaf_modules=leaf_modules if leaf_modules is not None else leaf_modules_of(spec, model),
                example_inputs=example_inputs if example_inputs is not None else
                examples(spec, model_dtype(model)) if spec.inputs else None,
                dynamic_shapes=dynamic_shapes)
