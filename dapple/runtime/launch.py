"""Run a function on N local processes through torch's elastic launcher (what torchrun uses)."""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable

from ..core.checks import is_int
from ..core.dist import free_port


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, start_timeout: float = 120.0,
           monitor_interval: float = 0.05) -> dict[int, Any]:
    """Call ``fn(*args)`` in ``nprocs`` fresh processes with torchrun's environment set.

    Each process sees RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, so ``dapple.pipeline``
    (or ``torch.distributed.init_process_group()``) joins the group without arguments.

    Args:
        fn: an importable (module-level) function; it and its arguments must be picklable.
        nprocs: how many processes (ranks) to start.
        *args: the arguments of every call.
        start_timeout: seconds the processes have to join the rendezvous.
        monitor_interval: seconds between the launcher's checks on its processes.

    Returns:
        {rank: fn's return value}.

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a process failed (the others are
            stopped); it carries the failing rank's traceback.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # torch's elastic stack: only launch

    if not is_int(nprocs, 1):
        raise ValueError(f"nprocs: expected a positive integer, got {nprocs!r}")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=f"dapple-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
                          monitor_interval=monitor_interval, start_method="spawn",
                          rdzv_configs={"join_timeout": start_timeout})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return elastic_launch(config, fn)(*args)
