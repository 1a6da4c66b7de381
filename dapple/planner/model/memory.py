"""Device memory of a stage: parameters x optimizer factor + K_i saved micro-batch slices (paper V-C, D)."""

from __future__ import annotations

import math

GB = 1e9


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
                       warmup: int = 1) -> None:
    """Raise ValueError naming the stage and by how much it exceeds device memory with K_i = ``warmup``."""
    need = stage_memory(static_bytes, saved_bytes, warmup)
    if need > device_memory:
        raise ValueError(
            f"stage {stage} does not fit in device memory: it needs {need / GB:.3f} GB "
            f"(parameters x optimizer factor {static_bytes / GB:.3f} GB + {warmup} x {saved_bytes / GB:.3f} GB of "
            f"saved activations per micro-batch slice) but a device has {device_memory / GB:.3f} GB: exceeds by "
            f"{(need - device_memory) / GB:.3f} GB; use more replicas or stages, a smaller micro-batch, or a "
            f"smaller warmup K_{stage}")
