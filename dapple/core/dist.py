"""What the profiler's probes and the runtime share over torch.distributed: the error, the device, timeouts."""

from __future__ import annotations

import os
import random
import socket
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .checks import is_finite

MIN_TIMEOUT = 1e-3  # seconds: waits take whole milliseconds, and gloo reads 0 ms as "no timeout" (measured)
WATCHDOG_GRACE = 30.0  # seconds NCCL's watchdog waits beyond twice dapple's timeout (group_timeout)


class PipelineError(RuntimeError):
    """A transfer or collective failed or timed out; the message names the rank, stage, peer and micro-batch."""


LOWEST_PORT = 10000  # free_port draws from here up to the ephemeral range (clear of the well-known ports)


def _ephemeral_ports() -> tuple[int, int]:
    """The range the OS takes outgoing connections' local ports from (Linux's file; its default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port that was free a moment ago on this machine, for a store that a process binds seconds later.

    It is drawn below the OS's ephemeral range: a port the OS handed out (bind to port 0) can meanwhile become
    the local port of an outgoing connection (NCCL opens many), and the store then fails with EADDRINUSE while
    its clients wait on the wrong port (seen running tests in parallel on an H100 machine).
    """
    low = _ephemeral_ports()[0]
    rng = random.SystemRandom()
    for _ in range(64 if low - LOWEST_PORT > 1024 else 0):  # 64 tries, where 1024+ ports lie below the range
        port = rng.randrange(LOWEST_PORT, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (torch's distributed errors run to many), or its type's name."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def bounded(timeout: float, what: str, call: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, a step bounded by ``timeout`` seconds (a wait, or a blocking step on a group
    with that timeout); if it fails or times out, a PipelineError "``what`` failed or timed out (timeout ...s):
    <its first line>"."""
    try:
        return call(*args, **kwargs)
    except Exception as e:
        raise PipelineError(f"{what} failed or timed out (timeout {timeout:g}s): {first_line(e)}") from e


def wait_for(work: Any, timeout: float, what: str, device: torch.device | None = None) -> None:
    """Wait on an async transfer or collective for at most ``timeout`` seconds (:func:`bounded`). On a CUDA
    ``device`` the host then waits for the data too (NCCL's wait only orders the stream). ``Work.wait`` is
    typed to return a bool: a backend that returns False instead of raising has not finished, so that is a
    timeout too."""
    if bounded(timeout, what, work.wait, timeout=timedelta(seconds=timeout)) is False:
        raise PipelineError(f"{what} failed or timed out (timeout {timeout:g}s): the wait returned False")
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(device: torch.device, timeout: float, what: str, group: Any = None) -> None:
    """A barrier bounded by ``timeout``: an AllReduce of one number that every rank of ``group`` waits on."""
    wait_for(dist.all_reduce(torch.zeros(1, device=device), group=group, async_op=True), timeout, what)


def timeout_seconds(name: str, value: Any) -> float:
    """``value`` as float seconds; ValueError unless it is a finite number >= :data:`MIN_TIMEOUT`."""
    if not is_finite(value, MIN_TIMEOUT):
        raise ValueError(f"{name}: expected a finite number of seconds >= {MIN_TIMEOUT:g} (waits are bounded in "
                         f"whole milliseconds), got {value!r}")
    return float(value)


def group_timeout(timeout: float, backend: str) -> timedelta:
    """The timeout to create a process group of ``backend`` with, for dapple's waits bounded by ``timeout``.

    On NCCL the group's timeout is also its watchdog's, which takes the whole process down when an op outlives
    it, without dapple's error (which names the stage and micro-batch). dapple waits with its own timeout, from
    the op's start as the watchdog counts, but may reach a hung op's wait a step after posting it (a send is
    waited at the end of the step): NCCL groups get 2 x timeout + :data:`WATCHDOG_GRACE`. gloo has no watchdog,
    and its group timeout bounds the group's creation: the timeout as is."""
    return timedelta(seconds=2 * timeout + WATCHDOG_GRACE if "nccl" in str(backend) else timeout)


SHARE_GPUS = "DAPPLE_SHARE_GPUS"  # "1": several local ranks on one GPU (testing a plan on fewer GPUs)


def local_rank() -> int:
    """This process's index among those of its server: LOCAL_RANK (torchrun), else the rank modulo the GPUs."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    n = torch.cuda.device_count()
    return (dist.get_rank() % n) if dist.is_initialized() and n else 0


def cuda_device() -> torch.device:
    """This rank's GPU, ``cuda:LOCAL_RANK``; ValueError where the server has fewer GPUs, unless DAPPLE_SHARE_GPUS=1.

    Sharing maps local rank r to GPU r mod (GPUs) and gives each rank its own NCCL host id, since NCCL
    refuses two ranks of one host on one GPU ("Duplicate GPU detected"): the ranks then exchange data
    through host sockets, which is right for checking a plan's numbers and wrong for timing it.
    """
    rank, count = local_rank(), torch.cuda.device_count()
    if rank < count:
        return torch.device("cuda", rank)
    if os.environ.get(SHARE_GPUS) != "1":
        raise ValueError(f"LOCAL_RANK {rank}: this server has {count} CUDA device(s) (cuda:0 .. cuda:{count - 1}); "
                         f"start one process per GPU (torchrun --nproc-per-node {count}), pass backend='gloo' to "
                         f"train on the CPU, or set {SHARE_GPUS}=1 to put several ranks on one GPU (for testing)")
    os.environ.setdefault("NCCL_HOSTID", f"dapple-shared-gpu-rank-{os.environ.get('RANK', rank)}")
    if os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE"):  # one server: loopback reaches all
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    return torch.device("cuda", rank % count)


def backends(group: Any = None) -> dict[str, str]:
    """Device type -> backend of ``group`` (default: the default group), e.g. {"cpu": "gloo", "cuda": "nccl"}.

    ``init_process_group()`` without a backend reports "undefined" from ``get_backend`` and registers only
    the accelerator's backend (NCCL on a CUDA machine), so the map is read from the group's backend config.
    """
    config = getattr(dist, "get_backend_config", None)
    text = str(config(group)) if config is not None else str(dist.get_backend(group))
    if ":" not in text:  # a torch without get_backend_config: one backend name
        return {"cuda": text} if text == "nccl" else {"cpu": text}
    return dict(pair.strip().split(":", 1) for pair in text.split(",") if pair.strip())


def group_device(group: Any = None) -> torch.device:
    """The device this rank's tensors for ``group`` live on: its own GPU where the group runs NCCL on CUDA
    (``torch.cuda.set_device`` is called), else the CPU; ValueError if the group has a backend for neither."""
    have = backends(group)
    if torch.cuda.is_available() and (have.get("cuda") == "nccl" or ("cuda" in have and "cpu" not in have)):
        device = cuda_device()
        torch.cuda.set_device(device)
        return device
    if "cpu" in have:
        return torch.device("cpu")
    raise ValueError(f"the process group's backends {have} serve neither CUDA (available: "
                     f"{torch.cuda.is_available()}) nor the CPU; initialise it with backend 'nccl' or 'gloo'")
