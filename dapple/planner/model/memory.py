"""Device memory of a stage: parameters x optimizer factor + K_i in-flight micro-batch slices (paper V-C, D), with
activation recomputation, mixed precision and optimizer state sharded over a stage's replicas (ZeRO-1)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple, Sequence

from ...core.plan import MIXED_PRECISIONS
from ...core.schedule import stage_holds

if TYPE_CHECKING:
    from ...core.plan import Stage
    from ...core.profile import Profile
    from .cost import CostModel

GB = 1e9
WEIGHTS_AND_GRADIENTS = 2.0  # of the optimizer factor, what every replica holds whole: the weights and gradients
# dapple.plan's: never, every stage (the whole stage, layer by layer, selectively), only where memory binds
# (planning.py)
RECOMPUTE_MODES = (False, True, "layers", "selective", "auto")


class NoFitError(ValueError):
    """A stage, a plan or every plan does not fit in device memory (the message says which and by how much)."""


def recompute_mode(recompute: object, modes: tuple = RECOMPUTE_MODES) -> None:
    """ValueError naming ``recompute`` unless it is one of ``modes`` (True and False themselves, not 1 or 0)."""
    if not any(recompute is m if isinstance(m, bool) else recompute == m for m in modes):
        raise ValueError(f"recompute: expected one of {modes}, got {recompute!r}")


def activation_scale(mixed_precision: str | None) -> float:
    """Bytes of an activation under ``mixed_precision`` per byte the profile measured (fp32): 0.5 under bf16/fp16
    (autocast makes the layers' outputs half precision), 1 in full precision (None).

    Raises:
        ValueError: ``mixed_precision`` is none of None, "bf16", "fp16" (naming it).
    """
    if mixed_precision is None:
        return 1.0
    if mixed_precision not in MIXED_PRECISIONS:  # each an autocast dtype of half the bytes of fp32
        raise ValueError(f"mixed_precision: expected one of {MIXED_PRECISIONS} or None (full precision), got "
                         f"{mixed_precision!r}")
    return 0.5


def static_factor(optimizer_factor: float, replicas: int = 1) -> float:
    """Static bytes per parameter byte on each replica of a stage whose optimizer state is sharded over
    ``replicas`` of them (ZeRO-1; 1: not sharded): every replica holds the weights and gradients whole, and 1 /
    ``replicas`` of the rest of ``optimizer_factor`` (Adam's two moments of the default 4): 4 -> 2 + 2 / r."""
    held = min(optimizer_factor, WEIGHTS_AND_GRADIENTS)
    return held + (optimizer_factor - held) / replicas


class StageBytes(NamedTuple):
    """What a stage holds: ``static`` always, ``per_slice`` per micro-batch slice in flight, ``once`` beside them.

    Without recomputation a slice keeps all its saved activations (``once`` = 0); a recomputing stage keeps only
    its inputs per slice, plus one slice's full activations while it runs a recomputed backward (``once``).
    """

    static: float  # parameters x optimizer factor (its optimizer part / replicas where sharded)
    per_slice: float
    once: float = 0.0

    def peak(self, warmup: int) -> float:
        """Peak bytes with ``warmup`` (K_i) micro-batch slices in flight."""
        return self.static + self.once + warmup * self.per_slice

    def slices(self, device_memory: float) -> int:
        """:func:`slices_that_fit` of these bytes."""
        return slices_that_fit(self.static + self.once, self.per_slice, device_memory)


def slices_that_fit(static_bytes: float, saved_bytes: float, device_memory: float) -> int:
    """D of paper V-C: how many micro-batch slices' saved activations fit beside the static bytes.

    Returns 0 when not even one fits (the stage is infeasible); a large number when nothing is saved.
    """
    free = device_memory - static_bytes
    if free < saved_bytes or free < 0:
        return 0
    if saved_bytes <= 0:
        return 1 << 30
    return int(math.floor(free / saved_bytes))


def stage_memory(static_bytes: float, saved_bytes: float, warmup: int) -> float:
    """Peak bytes of a stage: params x optimizer factor + K_i x saved activations of one slice."""
    return static_bytes + warmup * saved_bytes


def check_stage_memory(stage: int, static_bytes: float, saved_bytes: float, device_memory: float,
                       warmup: int = 1, recomputed: float | None = None) -> None:
    """Raise NoFitError naming the stage and by how much it exceeds device memory with K_i = ``warmup``.

    Args:
        recomputed: for a recomputing stage, the activations of the one slice it recomputes at a time
            (``saved_bytes`` is then what a slice in flight keeps); None: the stage does not recompute.
    """
    once = recomputed or 0.0
    need = stage_memory(static_bytes + once, saved_bytes, warmup)
    if need <= device_memory:
        return
    held = (f"{warmup} x {saved_bytes / GB:.3f} GB of saved activations per micro-batch slice" if recomputed is None
            else f"{warmup} x {saved_bytes / GB:.3f} GB kept per micro-batch slice + {once / GB:.3f} GB of one "
                 f"recomputed slice's activations")
    raise NoFitError(
        f"stage {stage} does not fit in device memory: it needs {need / GB:.3f} GB "
        f"(parameters x optimizer factor {static_bytes / GB:.3f} GB + {held}) but a device has "
        f"{device_memory / GB:.3f} GB: exceeds by {(need - device_memory) / GB:.3f} GB; use more replicas or stages, "
        f"a smaller micro-batch, a smaller warmup K_{stage}"
        # (recomputing holds more than a plain stage with K_i = 1: it helps only a stage holding more)
        + (", activation recomputation (recompute=True or \"auto\")" if recomputed is None and warmup > 1 else "")
        + " or mixed precision")


def split_backward_unfit(cm: "CostModel", stages: Sequence["Stage"], num_micro_batches: int, memory: float) -> str:
    """Why a split-backward schedule (zb-h1) on ``stages`` (their K_i set) does not fit somewhere ("" where it
    fits): each stage holds ``core.schedule.stage_holds`` micro-batches until their W. A recomputing stage is left
    out (its backward runs whole in B: it holds what it holds under dapple)."""
    warmups = [s.warmup for s in stages if s.warmup is not None]
    if len(warmups) != len(stages):
        raise ValueError(f"split_backward_unfit: every stage needs its warmup K_i, got {[s.warmup for s in stages]}")
    holds = stage_holds(warmups, num_micro_batches)
    for i, (st, h) in enumerate(zip(stages, holds)):
        if st.recompute:
            continue
        a, c = st.layers
        need = cm.static_bytes(a, c, st.replicas) + h * cm.saved_bytes(a, c, st.replicas)
        if need > memory:
            return (f"stage {i} would hold {h} micro-batches until their W: {need / 1e9:.3g} GB > "
                    f"{memory / 1e9:.3g} GB of device memory")
    return ""


def memory_needed(profile: "Profile", micro_batch_size: int = 1, *, optimizer_factor: float = 4.0,
                  mixed_precision: str | None = None, recompute: bool = False) -> float:
    """Bytes one device needs to train the whole model alone (one stage, one micro-batch in flight), as the
    planner's memory model counts them: parameters x ``optimizer_factor`` + one micro-batch's saved activations.

    A cluster whose ``device_memory`` is below this cannot run the model data-parallel, so :func:`dapple.plan`
    must pipeline it: ``Cluster.local(4, device_memory=0.6 * memory_needed(prof))`` plans a pipeline for a model
    that would fit one device.

    Args:
        profile: the model's profile.
        micro_batch_size: rows of the micro-batch in flight (1: the least any plan of one stage needs).
        optimizer_factor: bytes held per parameter byte (4: fp32 weights, gradients and Adam's two moments), as
            :func:`dapple.plan` takes it.
        mixed_precision: "bf16" or "fp16" (activations take half the profiled bytes), or None.
        recompute: the stage recomputes its forward in its backward (keeps only its inputs per micro-batch).
    """
    from ...core.cluster import Cluster  # (imported here: the cost model imports this module)
    from .cost import CostModel

    one = Cluster(servers=1, devices_per_server=1, intra_bandwidth=1.0, inter_bandwidth=1.0)
    cm = CostModel(profile, one, micro_batch_size, optimizer_factor, recompute=recompute,
                   mixed_precision=mixed_precision)
    return cm.stage_bytes(0, profile.num_layers, 1, recompute).peak(1)
