"""torch.compile of a stage: the options, the schedules it cannot serve, one compiled module per stage module."""

from __future__ import annotations

from typing import Any, Mapping, Sequence, cast

import torch
from torch import nn

from ..core.schedule import SPLIT_BACKWARD


class StageCompiler:
    """Compiles the modules that run a stage's forwards (the stage, and its evaluation twin) once each, with the
    same ``torch.compile`` options. A compiled module keeps the stage's parameters; torch.compile's guards
    recompile it for a new input shape or a train/eval switch, as for any compiled module."""

    def __init__(self, options: dict[str, Any]):
        self.options = options
        self._done: dict[int, nn.Module] = {}

    def describe(self) -> str:
        """The options as text that is the same on every rank given the same ones (a callable by its name)."""
        def text(v: Any) -> str:
            return f"{v.__module__}.{v.__qualname__}" if callable(v) and hasattr(v, "__qualname__") else repr(v)
        return ", ".join(f"{k}={text(v)}" for k, v in sorted(self.options.items())) or "defaults"

    def __call__(self, module: nn.Module) -> nn.Module:
        if id(module) not in self._done:
            # a module compiles to a module (an OptimizedModule), which torch's stubs type as a bare callable
            self._done[id(module)] = cast(nn.Module, torch.compile(module, **self.options))
        return self._done[id(module)]


def stage_compiler(compile: Any, schedule: str, recompute: Sequence[Any]) -> StageCompiler | None:
    """The compiler for ``dapple.pipeline(..., compile=)``: None for False; torch.compile's defaults for True; a
    mapping is torch.compile's keyword arguments (``{"backend": "aot_eager"}``, ``{"mode": "max-autotune"}``).

    Raises:
        TypeError: ``compile`` is none of those.
        ValueError: a split-backward schedule (zb-h1) where some stage does not recompute (``recompute``: per
            stage; a recomputing stage runs its whole backward in B), whose weight gradients a compiled stage
            cannot defer.
    """
    if compile is False or compile is None:
        return None
    if compile is not True and not isinstance(compile, Mapping):
        raise TypeError(f"compile: expected True, False or a dict of torch.compile's keyword arguments, got "
                        f"{compile!r}")
    if schedule in SPLIT_BACKWARD and not all(recompute):
        raise ValueError(f"compile: the plan's schedule {schedule!r} splits each backward into input gradients (B) "
                         f"and weight gradients (W, later), but a compiled stage's backward is one autograd node "
                         f"that computes both, so W would run it a second time; run compiled stages under "
                         f"schedule 'dapple' (re-plan with schedule='dapple', or set plan.schedule), or zb-h1 "
                         f"without compile")
    options = {} if compile is True else dict(compile)
    if "fullgraph" in options and not isinstance(options["fullgraph"], bool):
        raise TypeError(f"compile['fullgraph']: expected True or False, got {options['fullgraph']!r}")
    return StageCompiler(options)
