"""Tracing a model with torch.fx, turning fx's failures into errors that show the construct and the fix."""

from __future__ import annotations

import linecache
import os
import traceback
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch import nn

from ..core.dist import first_line

LeafSpec = Iterable[type | str]  # module classes, or qualified module names ("blocks.3")


class TraceError(RuntimeError):
    """torch.fx could not trace the model; the message shows where and what to do about it."""


class _Tracer(fx.Tracer):
    """fx.Tracer that also treats the user's chosen module classes / qualified names as leaves."""

    def __init__(self, leaf_modules: LeafSpec = ()):
        super().__init__()
        leaves = list(leaf_modules)
        self._leaf_types = tuple(x for x in leaves if isinstance(x, type))
        self._leaf_names = {x for x in leaves if isinstance(x, str)}
        bad = [x for x in leaves if not isinstance(x, (type, str))]
        if bad:
            raise TypeError(f"leaf_modules: expected module classes or qualified names, got {bad!r}")

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self._leaf_names or (self._leaf_types and isinstance(m, self._leaf_types)):
            return True
        return super().is_leaf_module(m, module_qualified_name)


def symbolic_trace(model: nn.Module, concrete_args: dict[str, Any] | None = None,
                   leaf_modules: LeafSpec = ()) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` with user leaf modules; failures raise :class:`TraceError`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module to trace, got {type(model).__name__}")
    tracer = _Tracer(leaf_modules)
    try:
        graph = tracer.trace(model, concrete_args=concrete_args)
    except Exception as e:  # fx raises TraceError, TypeError, RuntimeError... for untraceable code
        raise TraceError(_explain(model, e)) from e
    name = type(model).__name__
    gm = fx.GraphModule(tracer.root, graph, name)
    return gm


def user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch itself: the model code fx choked on."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(__file__)  # dapple/profiler: our own tracing wrappers
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith((torch_dir, here)) and not f.filename.startswith("<")]
    return frames[-1] if frames else None


def _explain(model: nn.Module, exc: BaseException) -> str:
    frame = user_frame(exc)
    where = ""
    if frame is not None:
        code = frame.line or ""
        if not code and frame.lineno is not None:
            code = linecache.getline(frame.filename, frame.lineno)
        code = code.strip()
        where = f"\n  at {frame.filename}:{frame.lineno}, in {frame.name}:\n      {code}"
    first = first_line(exc)
    return (
        f"torch.fx could not trace {type(model).__name__}: {type(exc).__name__}: {first}{where}\n"
        "What to do:\n"
        "  - control flow or asserts on tensor values/shapes: mark the module that contains it as a leaf "
        "(leaf_modules=[ThatBlock] or ['blocks.0']) so it runs as one opaque call, or move the check out of "
        "forward();\n"
        "  - a Python-level argument (a flag, a None target): fix it with concrete_args={'name': value};\n"
        "  - iterating over or indexing a tensor's shape in Python: use tensor ops (x.size(1), torch.arange) "
        "instead of Python ints where possible."
    )
