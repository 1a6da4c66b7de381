"""Choosing the tracer (torch.fx, or torch.export for models fx cannot trace) and exporting a model for dapple."""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import warnings
from typing import Any, Iterator, cast

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from .batch import as_tensors, resize
from .by_name import absent_arguments, given_first, keyword_tensors
from .export_graph import (
    canonical_get_attrs,
    clean_module_stacks,
    is_dynamic_size,
    rename_export_bodies,
    user_stacklevel,
    views_as_reshapes,
)
from .fx_trace import LeafSpec, TraceError, symbolic_trace, user_frame
from .outputs import rebuild_output

METHODS = ("auto", "fx", "export")
EXPORT_MIN_TORCH = (2, 9)  # before it, ep.module() loses the input guards, and Dim.AUTO is missing or weaker


def _torch_version() -> tuple[int, ...]:
    return tuple(int(v) for v in re.findall(r"\d+", torch.__version__)[:2])  # "2.4.1+cpu" -> (2, 4)


def trace_graph(model: nn.Module, *, method: str = "auto", concrete_args: dict[str, Any] | None = None,
                leaf_modules: LeafSpec = (), example_inputs: Any = None, dynamic_shapes: Any = None
                ) -> fx.GraphModule:
    """Trace ``model`` with torch.fx (``method="fx"``), torch.export (``"export"``, needs ``example_inputs``) or
    fx with a fall-back to export when fx fails (``"auto"``); failures raise TraceError naming what to do."""
    if method not in METHODS:
        raise ValueError(f"tracer: expected one of {METHODS}, got {method!r}")
    fixed = training_args(model, concrete_args)  # under torch.export, bound into forward: not an input
    named = keyword_tensors(example_inputs, "example_inputs")  # inputs by name: only those are the model's inputs
    if method == "export":
        if list(leaf_modules):
            raise ValueError("leaf_modules apply to torch.fx only (torch.export traces through every module); "
                             "drop them or use tracer='fx'")
        return exported_graph(model, example_inputs, dynamic_shapes=dynamic_shapes, kwargs=concrete_args,
                              bound=fixed)
    absent = absent_arguments(model, named, concrete_args) if named is not None else {}
    try:
        gm = symbolic_trace(model, concrete_args={**absent, **(concrete_args or {}), **fixed} or None,
                            leaf_modules=leaf_modules)
    except TraceError as fx_error:
        if method == "fx":
            raise
        if example_inputs is None:
            raise TraceError(f"torch.fx could not trace {type(model).__name__}; torch.export may: pass "
                             "example_inputs=... (a tensor, a tuple of tensors, or tensors by name in a dict) with "
                             "tracer='auto' or 'export' (a plan made from a profile of the model carries them: then "
                             f"dapple.pipeline needs neither).\n\n{fx_error}") from fx_error
        try:
            return exported_graph(model, example_inputs, dynamic_shapes=dynamic_shapes, kwargs=concrete_args,
                                  bound=fixed)
        except TraceError as export_error:
            raise TraceError(f"{fx_error}\n\ntorch.export could not trace it either:\n{export_error}"
                             ) from export_error
    if named is not None:
        given_first(gm, list(named))
    gm.meta["dapple_trace"] = {"method": "fx"}
    return gm


def training_args(model: nn.Module, concrete_args: dict[str, Any] | None) -> dict[str, Any]:
    """``{"use_cache": False}`` where ``forward`` takes ``use_cache`` and ``concrete_args`` do not set it: training
    never wants a key/value cache, and a cache object in the output is no tensor (Hugging Face models)."""
    if not isinstance(model, nn.Module):
        return {}  # the tracer says what is wrong with it
    if "use_cache" in inspect.signature(model.forward).parameters and "use_cache" not in (concrete_args or {}):
        return {"use_cache": False}
    return {}


def exported_graph(model: nn.Module, example_inputs: Any, *, dynamic_shapes: Any = None,
                   kwargs: dict[str, Any] | None = None, bound: dict[str, Any] | None = None) -> fx.GraphModule:
    """``torch.export.export`` in training mode, batch dim dynamic, unlifted and normalised for dapple.

    The graph it returns splits and runs like an fx graph; what differs:

    - Ops are ATen overloads (``aten.linear.default``), not module calls. Every parameter and buffer is a
      ``get_attr`` node targeting its name in the original model (a tied parameter under its first name) and
      holding the model's own tensor; get_attr nodes are input-only, copied into each layer that reads them.
    - Training mode is baked in (``aten.dropout(x, p, True)``, batch-norm statistics): ``.eval()`` changes
      nothing. In-place ops stay in place. Every ``aten.view`` is made an ``aten.reshape``, as export drops
      ``.contiguous()`` where it was a no-op on the tracing device. ``torch.no_grad()`` / autocast regions become
      higher-order ops calling a GraphModule held as ``_export_body_<i>``.
    - Shapes are symbolic: dim 0 of every input is dynamic, other dims ``Dim.AUTO`` unless ``dynamic_shapes``
      says otherwise; ops read sizes from ``aten.sym_size.int`` nodes, which :func:`~.export_graph.localise_sizes`
      moves onto tensors each layer already has, so no symbolic int crosses a cut.
    - Guards: a ``_guards_fn`` call in layer 0 asserts what export assumed about input shapes, so a slice that
      breaks one fails in the first stage with ``Guard failed`` rather than taking another branch.
    - Factory ops carry the tracing device (``meta["dapple_trace"]["device"]``);
      :func:`~.export_graph.retarget_devices` points them at each stage's device.
    - Inputs are positional placeholders named after ``forward``'s arguments; ``kwargs`` (``concrete_args``) that
      ``forward`` names become placeholders with their value as default, as in fx; those its ``**kwargs`` takes,
      and ``bound``, are bound into ``forward`` (no input). The output node holds the model's own structure, or
      one node rebuilds it (a ``ModelOutput``: :mod:`~dapple.profiler.outputs`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module to trace, got {type(model).__name__}")
    if _torch_version() < EXPORT_MIN_TORCH:
        raise TraceError(f"tracing with torch.export needs torch >= {'.'.join(map(str, EXPORT_MIN_TORCH))}; this "
                         f"is torch {torch.__version__} (use tracer='fx', with concrete_args or leaf_modules for "
                         f"what fx cannot trace)")
    if example_inputs is None:
        raise ValueError("tracer='export' needs example_inputs (a tensor, a tuple of tensors or tensors by name, "
                         "batch along dim 0)")
    home = next((t.device for t in [*model.parameters(), *model.buffers()]), None)

    def fresh(t: torch.Tensor) -> torch.Tensor:
        # A dim of size 1 would be specialised (export's 0/1 rule): trace with two rows; the graph still runs one.
        # Fresh copies: an input that is a view (tokens[:, :-1]) would get guards on its base (idx._base.size()).
        t = t if home is None else t.to(home)
        return (resize(t, 2) if t.dim() > 0 and t.shape[0] == 1 else t).detach().clone()

    by_name = keyword_tensors(example_inputs, "example_inputs")
    order = list(inspect.signature(model.forward).parameters)
    tensors = {k: fresh(by_name[k]) for k in sorted(by_name, key=lambda k: order.index(k) if k in order else
                                                   len(order))} if by_name is not None else {}
    inputs = tuple(fresh(t) for t in as_tensors(example_inputs, "example_inputs")) if by_name is None else ()
    named, extra = _split_kwargs(model, kwargs or {})
    with _training(model), _bound_forward(model, {**extra, **(bound or {})}):
        spec = _dynamic_spec(model, inputs, dynamic_shapes, named, tensors)
        try:  # the inputs by name first, in forward's order (the traced model's positional order), then fixed ones
            ep = torch.export.export(model, inputs, kwargs={**tensors, **named}, dynamic_shapes=spec)
        except Exception as e:  # UserError, ValueError, data-dependent guards, unsupported ops...
            raise TraceError(_explain_export(model, e)) from e
    gm = ep.module()  # unlifted: parameters and buffers as get_attr; guards checked by a _guards_fn call
    names = _check_batch_dynamic(gm, model, dynamic_shapes is None)
    _warn_batch_guards(getattr(ep, "_guards_code", []), names)  # private in torch 2.13: used only for a warning
    _plain_io(gm, kwargs or {})
    clean_module_stacks(gm)
    canonical_get_attrs(gm, model)
    rename_export_bodies(gm)
    views_as_reshapes(gm)
    plain = fx.GraphModule(gm, gm.graph, type(model).__name__)  # plain module: train()/eval() allowed
    ranges = {str(k): str(v) for k, v in ep.range_constraints.items()}
    traced_on = home or next(iter([*inputs, *tensors.values()])).device
    plain.meta["dapple_trace"] = {"method": "export", "device": traced_on, "ranges": ranges}
    return plain


def _dynamic_spec(model: nn.Module, inputs: tuple[torch.Tensor, ...], user: Any, kwargs: dict[str, Any],
                  tensors: dict[str, torch.Tensor] | None = None) -> Any:
    """Per input (positional, or ``tensors`` by name): dim 0 dynamic; other dims Dim.AUTO by default, or as the
    user's spec says (dim 0 added).

    Keyed by ``forward``'s argument names, as export binds them (keywords a ``**kwargs`` takes nest under its
    name); fixed keyword values (``concrete_args``) get ``None`` (static).
    """
    sig = inspect.signature(model.forward)
    try:
        bound = sig.bind(*inputs, **(tensors or {}), **kwargs)
    except TypeError as e:
        raise ValueError(f"{len(inputs) or list(tensors or {})} example inputs and concrete_args {sorted(kwargs)} "
                         f"do not fit {type(model).__name__}.forward{sig}: {e}") from None
    slots: list[tuple[str, int | None]] = []  # per tensor input: its argument, and its index in *args
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            slots.extend((name, j) for j in range(len(value)))
        elif kind is not inspect.Parameter.VAR_KEYWORD and name not in kwargs:
            slots.append((name, None))
    given = [bound.arguments[name] if j is None else bound.arguments[name][j] for name, j in slots]
    per_input = _input_specs(tuple(given), user, [name for name, _ in slots])
    spec: dict[str, Any] = {name: None for name in bound.arguments}
    for (name, j), s in zip(slots, per_input):
        spec[name] = s if j is None else (*spec[name], s) if spec[name] else (s,)
    for name in bound.arguments:
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            spec[name] = {k: None for k in bound.arguments[name]}
    return spec


def _input_specs(inputs: tuple[torch.Tensor, ...], user: Any, names: list[str]) -> list[Any]:
    """Each positional input's dynamic dims: the default, or the user's (a tuple, or a dict by argument name)."""
    dim = torch.export.Dim
    if user is None:
        return [{0: dim.DYNAMIC, **{d: dim.AUTO for d in range(1, t.dim())}} for t in inputs]

    def with_batch(s: Any) -> Any:
        if s is None:
            return {0: dim.DYNAMIC}
        if isinstance(s, dict) and 0 not in s and all(isinstance(k, int) for k in s):
            return {0: dim.DYNAMIC, **s}
        return s

    if isinstance(user, (tuple, list)):
        if len(user) != len(inputs):
            raise ValueError(f"dynamic_shapes: expected one entry per example input ({len(inputs)}), got {len(user)}")
        return [with_batch(s) for s in user]
    if isinstance(user, dict):
        unknown = sorted(set(user) - set(names))
        if unknown:
            raise ValueError(f"dynamic_shapes: {unknown} name no example input (the inputs are {names})")
        return [with_batch(user.get(name)) for name in names]
    raise TypeError(f"dynamic_shapes: expected a tuple (one entry per input) or a dict by argument name, "
                    f"got {type(user).__name__}")


def _split_kwargs(model: nn.Module, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(values of ``forward``'s named parameters, values its ``**kwargs`` takes): export takes the first as
    inputs with a fixed value; the second are bound into ``forward`` (export's dynamic_shapes cannot describe a
    Python value inside ``**kwargs``)."""
    params = inspect.signature(model.forward).parameters
    named = {k for k, p in params.items() if p.kind not in (inspect.Parameter.VAR_KEYWORD,
                                                            inspect.Parameter.VAR_POSITIONAL)}
    return {k: v for k, v in kwargs.items() if k in named}, {k: v for k, v in kwargs.items() if k not in named}


@contextlib.contextmanager
def _bound_forward(model: nn.Module, extra: dict[str, Any]) -> Iterator[None]:
    """``model.forward`` with ``extra`` keyword values bound, for the block; the model's own forward after it."""
    if not extra:
        yield
        return
    own = model.__dict__.get("forward")  # an instance attribute the model had (hooks replace forward so)
    model.forward = functools.partial(model.forward, **extra)
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


@contextlib.contextmanager
def _training(model: nn.Module) -> Iterator[None]:
    """Export in training mode (dropout, BatchNorm batch statistics) with the RNG untouched; flags restored."""
    modes = [(m, m.training) for m in model.modules()]
    with torch.random.fork_rng(devices=[]):
        try:
            model.train()
            yield
        finally:
            for m, flag in modes:
                m.training = flag


def _explain_export(model: nn.Module, exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()][:8]
    frame = user_frame(exc)
    where = f"\n  at {frame.filename}:{frame.lineno}, in {frame.name}:\n      {(frame.line or '').strip()}" \
        if frame else ""
    batch = ("\nThe model fixes an input's batch dimension (dim 0): pipelines run micro-batch slices of varying "
             "rows, so dim 0 must stay dynamic (no reshape to a constant batch, no branch on x.shape[0])."
             if ".size()[0]" in str(exc) and "Constraints violated" in str(exc) else "")
    return (f"torch.export could not trace {type(model).__name__}: {type(exc).__name__}: " + "\n  ".join(lines) +
            where + batch +
            "\nWhat to do:\n"
            "  - a dimension the model fixes (a reshape to a constant, control flow on a size): leave it out of "
            "dynamic_shapes (dim 0, the batch, must stay dynamic);\n"
            "  - control flow on tensor values: torch.cond, or move it out of forward();\n"
            "  - torch.export.draft_export(model, args) lists every problem at once.")


def _input_placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _check_batch_dynamic(gm: fx.GraphModule, model: nn.Module, default: bool) -> list[str]:
    """TraceError if export fixed an input's dim 0; warn (default spec) about other dims it fixed."""
    names: list[str] = []
    fixed: list[str] = []
    for n in _input_placeholders(gm):
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        names.append(cast(str, n.target))  # a placeholder's target: the input's name
        if not is_dynamic_size(val.shape[0]):
            raise TraceError(f"torch.export fixed the batch dimension of {type(model).__name__}'s input "
                             f"{n.target!r} at {val.shape[0]}: pipelines run micro-batch slices of varying rows, "
                             "so dim 0 must stay dynamic. The model (a reshape to a constant batch, a branch on "
                             "x.shape[0]) or dynamic_shapes fixes it.")
        fixed += [f"{n.target} dim {d} = {int(s)}" for d, s in enumerate(val.shape) if not is_dynamic_size(s)]
    if default and fixed:
        warnings.warn(f"torch.export traced {type(model).__name__} for these fixed sizes only: {', '.join(fixed)} "
                      "(the model's code ties them to constants); other sizes fail with 'Guard failed'. Pass "
                      "dynamic_shapes=... to choose the dynamic dims yourself and silence this.",
                      stacklevel=user_stacklevel())
    return names


def _warn_batch_guards(guards: list[str], names: list[str]) -> None:
    """Warn about guards on the batch size beyond a range (``x.size()[0] % 2 == 0``): some slices will fail."""
    def same_rows(g: str) -> bool:  # inputs' batch sizes equal (2*x.size()[0] == 2*mask.size()[0]): every slice's
        return re.fullmatch(r"[\s()\d*B]+==[\s()\d*B]+", re.sub(r"L\['\w+'\]\.size\(\)\[0\]", "B", g)) is not None

    batch = [g for g in guards if any(f"['{name}'].size()[0]" in g for name in names) and not same_rows(g)
             and not re.fullmatch(r"\s*L\['\w+'\]\.size\(\)\[0\]\s*(<=|>=|<|>|==)\s*L?[\w'\[\]().]*\s*", g)]
    if batch:
        warnings.warn(f"torch.export assumed {'; '.join(batch)} about the batch size: micro-batch slices that "
                      "break it fail with 'Guard failed' (the model branches on its batch size).",
                      stacklevel=user_stacklevel())


def _plain_io(gm: fx.GraphModule, kwargs: dict[str, Any]) -> None:
    """Positional placeholders (Python-level values as defaults) and the model's own output structure: in the
    output node where fx can hold it (tensors in tuples, lists, dicts), else rebuilt by one node (a
    ``ModelOutput``, any pytree type)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = list(out.args[0])
    out_spec = gm._out_spec  # set by ep.module()
    if out_spec is None:
        raise RuntimeError(f"torch.export's {type(gm).__name__} holds no output structure (_out_spec)")
    structure = pytree.tree_unflatten(leaves, out_spec)
    if _plain(structure):
        out.args = (structure,)
    else:
        rebuild_output(gm.graph, leaves, out_spec)
    for n in _input_placeholders(gm):
        if not isinstance(n.meta.get("val"), torch.Tensor) and n.target in kwargs:
            n.args = (kwargs[n.target],)  # a fixed Python value: a default, as fx gives concrete_args
    gm.graph._codegen = fx.graph.CodeGen()


def _plain(x: Any) -> bool:
    """Nodes and constants in tuples (named ones too), lists and dicts: what an fx output node can hold."""
    if type(x) in (tuple, list) or (isinstance(x, tuple) and hasattr(x, "_fields")):
        return all(_plain(v) for v in x)
    if type(x) is dict:
        return all(_plain(v) for v in x.values())
    return isinstance(x, (fx.Node, type(None), bool, int, float, str))


export_graph = exported_graph  # its name before (beside the module export_graph.py): kept importable
