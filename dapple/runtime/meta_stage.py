"""A stage of a meta-device model: this rank makes only its stage's tensors real, on its device, and initialises
them; the other stages stay on the meta device."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..core.meta import InitFn, Materialised, default_init, is_meta_model, materialise, meta_left
from ..profiler.layer_graph import LayerGraph
from .stages import StageGraph


def materialise_stage(model: nn.Module, lg: LayerGraph, graphs: Sequence[StageGraph], stages: Sequence[int],
                      device: torch.device, init_fn: InitFn | None, where: str) -> Materialised | None:
    """Make the meta tensors of ``stages`` (a rank's stage, or its chunks) real on ``device`` (in the model, its
    traced graph and every stage module alike, so names and tied copies stay consistent) and initialise them with
    ``init_fn`` (None: the model's default, :func:`~dapple.core.meta.default_init`); None where the model has no
    meta tensor.

    Raises:
        ValueError: naming a tensor init_fn left uninitialised, or one the stage still holds on the meta device.
    """
    if not is_meta_model(model):
        return None
    modules = [graphs[s].module for s in stages]
    wanted = list({id(t): t for m in modules for t in [*m.parameters(), *m.buffers()]}.values())
    holders = [model, lg.gm, *(g.module for g in graphs)]
    done = materialise(model, wanted, holders, device, init_fn or default_init(model), where=where)
    left = [name for m in modules for name in meta_left(m)]
    if left:
        raise ValueError(f"{where}: the stage holds tensors on the meta device that are neither parameters nor "
                         f"buffers of the model, so nothing can materialise them: {left[:6]} (make them buffers, "
                         f"or build them inside forward)")
    return done
