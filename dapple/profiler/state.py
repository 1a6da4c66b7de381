"""Leaving the model as it was: device, train/eval flags, buffers (BatchNorm statistics), gradients, RNG."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


def model_device(model: nn.Module) -> torch.device:
    """The one device holding the model's parameters and buffers (cpu for a stateless model)."""
    devices = {t.device for t in list(model.parameters()) + list(model.buffers())}
    if len(devices) > 1:
        raise ValueError(f"model: parameters and buffers lie on several devices {sorted(map(str, devices))}; "
                         "the profiler measures a model on one device")
    return devices.pop() if devices else torch.device("cpu")


def model_dtype(model: nn.Module) -> torch.dtype:
    """The floating-point dtype of the model's parameters (the default dtype if it has none)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch.device; None -> cuda if available, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: expected 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested, but CUDA is not available here (use 'cpu')")
    return dev


@contextlib.contextmanager
def on_device(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Move ``model`` to ``device`` for the duration (parameter objects are kept), and back afterwards."""
    home = model_device(model)
    if home == device:
        yield
        return
    model.to(device)
    try:
        yield
    finally:
        model.to(home)


@contextlib.contextmanager
def untouched(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Run in training mode with gradients cleared; afterwards restore flags, buffers, gradients and RNG."""
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        try:
            for p, _ in grads:
                p.grad = None
            model.train()
            yield
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            for p, g in grads:
                p.grad = g
            for m, flag in modes:
                m.training = flag
