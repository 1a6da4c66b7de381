"""The default process group and this rank's device: from torchrun's environment, NCCL+CUDA or gloo+CPU."""

from __future__ import annotations

import atexit
import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.dist import bounded, cuda_device, free_port, group_device, group_timeout, timeout_seconds


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: global rank, world size, backend and the device its stage runs on."""

    rank: int
    world_size: int
    backend: str
    device: torch.device


def default_backend() -> str:
    """NCCL when CUDA is available, gloo otherwise (chosen at run time; one code path for both)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _join(backend: str, timeout: float, seconds: timedelta) -> None:
    """``init_process_group`` from torchrun's environment, with the rendezvous (waiting for every rank) bounded
    by dapple's ``timeout`` and the group by ``seconds``: on NCCL that is the watchdog's longer
    :func:`group_timeout`, which ``init_process_group(timeout=...)`` would also give the rendezvous."""
    store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout)))
    store.set_timeout(seconds)
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world,
                            timeout=seconds)


def init_distributed(timeout: float = 60.0, backend: str | None = None) -> DistContext:
    """Initialise the default process group unless the user already did, and pick this rank's device.

    Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) the group is initialised from the
    environment; a plain single process (no such variables) gets a world of one. A group the user made is
    kept (``backend`` must then be its backend or None). The device is ``cuda:LOCAL_RANK`` where the group
    runs NCCL on CUDA (also after a bare ``init_process_group()``), the CPU otherwise.
    """
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of PyTorch")
    timeout = timeout_seconds("timeout", timeout)
    if backend is not None and backend not in ("nccl", "gloo"):
        raise ValueError(f"backend: expected 'nccl', 'gloo' or None (NCCL where CUDA is available, else gloo), "
                         f"got {backend!r}")
    if not dist.is_initialized():
        backend = backend or default_backend()
        seconds = group_timeout(timeout, backend)  # on NCCL longer: the watchdog must not act before dapple
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if backend == "nccl":
                torch.cuda.set_device(cuda_device())
            bounded(timeout, f"rank {os.environ['RANK']}: joining the default process group of "
                    f"{os.environ['WORLD_SIZE']} ranks (did every rank start?)", _join, backend, timeout, seconds)
        else:  # not launched by torchrun: a world of one process
            store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=timeout))
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=seconds)
    elif backend is not None and dist.get_backend() != backend:
        raise ValueError(f"backend: got {backend!r}, but the default process group already runs "
                         f"{dist.get_backend()!r}; pass backend=None to use it")
    atexit.unregister(_collect_at_exit)  # registered once however many pipelines a process builds
    atexit.register(_collect_at_exit)
    device = group_device()
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=str(dist.get_backend()),
                       device=device)


def _collect_at_exit() -> None:
    """Free unreachable pipelines (their process groups and pending work) while the interpreter is alive: left to
    interpreter finalization, a gloo group's destructor can abort the process after training succeeded."""
    gc.collect()
