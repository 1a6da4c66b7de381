"""The training loop's state in a checkpoint: fp16's loss scale, an LR scheduler, each rank's random generators."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from .checkpoint_state import is_stored_tensor
from .engine import Pipeline

if TYPE_CHECKING:  # torch.distributed.checkpoint is imported on first use
    from torch.distributed.checkpoint.metadata import Metadata

RNG = "rng"  # key prefix of each rank's generator states: rng/<rank>/cpu, rng/<rank>/cuda


def is_scheduler(s: Any) -> bool:
    """An LR scheduler (or anything that saves and loads its state as one)."""
    return callable(getattr(s, "state_dict", None)) and callable(getattr(s, "load_state_dict", None)) \
        and hasattr(s, "optimizer")


def scheduler_state(scheduler: Any) -> dict:
    """The scheduler's state and class, and how many param groups its lists are per (saved from rank 0: a step's
    learning rates are the same on every rank)."""
    return {"class": f"{type(scheduler).__module__}.{type(scheduler).__qualname__}",
            "groups": len(scheduler.optimizer.param_groups), "state": scheduler.state_dict()}


def scheduler_target(scheduler: Any, saved: dict | None, path: Path) -> Callable[[], None]:
    """Check that ``saved`` is for ``scheduler``; return what gives it the saved state (once its optimizer has
    its own). Per-param-group lists are rebuilt where this rank's optimizer has another number of groups than
    rank 0 had: the learning rates from its groups, other values where every group had the same.

    Raises:
        ValueError: saved without a scheduler, or for another class.
    """
    if saved is None:
        raise ValueError(f"{path}: saved without a scheduler; load without one, or save with one")
    kind = f"{type(scheduler).__module__}.{type(scheduler).__qualname__}"
    if saved["class"] != kind:
        raise ValueError(f"{path}: the scheduler state is for {saved['class']}, the scheduler given is {kind}")

    def finish() -> None:
        state, groups = dict(saved["state"]), scheduler.optimizer.param_groups
        if len(groups) != saved["groups"]:
            for k, v in state.items():
                if not isinstance(v, list) or len(v) != saved["groups"]:
                    continue
                if k in ("base_lrs", "_last_lr"):
                    state[k] = [g.get("initial_lr", g["lr"]) if k == "base_lrs" else g["lr"] for g in groups]
                elif all(x == v[0] for x in v):
                    state[k] = [v[0]] * len(groups)
                else:
                    raise ValueError(f"{path}: the scheduler's {k!r} holds a value per param group ({v}) of rank 0's "
                                     f"{saved['groups']} groups; this rank's optimizer has {len(groups)}")
        scheduler.load_state_dict(state)
    return finish


def rng_states(pipe: Pipeline) -> dict[str, torch.Tensor]:
    """This rank's generator states under its own keys (what dropout draws from next)."""
    out = {f"{RNG}/{pipe.ctx.rank}/cpu": torch.get_rng_state()}
    if pipe.ctx.device.type == "cuda":
        out[f"{RNG}/{pipe.ctx.rank}/cuda"] = torch.cuda.get_rng_state(pipe.ctx.device)
    return out


def rng_targets(pipe: Pipeline, md: Metadata, meta: dict, sd: dict[str, Any]) -> Callable[[], None]:
    """Destinations in ``sd`` for this rank's saved generator states, when the checkpoint came from a job of as
    many ranks (under another world size there is no rank to take them from: the generators are left as they
    are); returns what sets them once read."""
    if meta.get("world_size") != pipe.ctx.world_size:
        return lambda: None
    mine = {k: m for k, m in md.state_dict_metadata.items() if k.startswith(f"{RNG}/{pipe.ctx.rank}/")}
    for k, m in mine.items():
        if not is_stored_tensor(m):
            raise ValueError(f"damaged checkpoint: generator state {k!r} is not stored as a tensor ({m})")
        sd[k] = torch.empty(m.size, dtype=m.properties.dtype)

    def finish() -> None:
        cpu, cuda = sd.get(f"{RNG}/{pipe.ctx.rank}/cpu"), sd.get(f"{RNG}/{pipe.ctx.rank}/cuda")
        if cpu is not None:
            torch.set_rng_state(cpu)
        if cuda is not None and pipe.ctx.device.type == "cuda":
            torch.cuda.set_rng_state(cuda, pipe.ctx.device)
    return finish


def load_scaler(pipe: Pipeline, saved: dict | None) -> None:
    """fp16's loss scale and its progress, where both the saved run and this one scale the loss."""
    if saved is not None and saved.get("enabled") and pipe.scaler.enabled:
        pipe.scaler.load_state_dict(saved)
