"""The device a probing rank measures on, and a host wait for the work queued there."""

from __future__ import annotations

import torch

from ...core.dist import group_device


def probe_device() -> torch.device:
    """This rank's device for probes: its own GPU (LOCAL_RANK) where the default group runs NCCL, else the CPU."""
    return group_device()


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished its queued work (a no-op on the CPU), so a clock read after it is when
    the transfer really ended."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
