"""Activation recomputation per stage: which stages recompute, and what cannot be recomputed faithfully."""

from __future__ import annotations

from typing import Any, Sequence

import torch.fx as fx
from torch import nn

from ..core.plan import Plan


def recomputing(plan: Plan, recompute: Any) -> list[bool]:
    """Per stage, whether it recomputes its forward in the backward.

    Args:
        plan: the plan; its stages' ``recompute`` fields are the default.
        recompute: None (as the plan says), True or False (every stage), or one bool per stage.
    """
    if recompute is None:
        return [s.recompute for s in plan.stages]
    if isinstance(recompute, bool):
        return [recompute] * plan.num_stages
    flags = list(recompute) if isinstance(recompute, Sequence) and not isinstance(recompute, str) else None
    if flags is None or len(flags) != plan.num_stages or not all(isinstance(f, bool) for f in flags):
        raise ValueError(f"recompute: expected None (the plan's), True, False or one bool per stage "
                         f"({plan.num_stages}), got {recompute!r}")
    return flags


def check_recomputable(module: nn.Module, stage: int) -> None:
    """ValueError unless running the stage's forward twice per micro-batch trains as running it once: a BatchNorm
    in training mode would update its running statistics twice."""
    norms = [name for name, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if isinstance(module, fx.GraphModule):
        norms += [n.name for n in module.graph.nodes if "batch_norm" in str(n.target) and n.op == "call_function"]
    if norms:
        raise ValueError(f"recompute: stage {stage} holds batch normalisation ({norms[:3]}), whose running "
                         f"statistics the recomputed forward would update a second time; recompute other stages")
