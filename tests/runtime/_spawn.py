"""Test helper: run a function on N processes with torchrun's environment; collect per-rank results."""

from __future__ import annotations

import os
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from dapple.core.dist import free_port


def _entry(fn: Callable, rank: int, world: int, port: int, q: Any, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    torch.set_num_threads(1)
    try:
        out = (rank, True, fn(*args))
    except BaseException:  # the traceback goes back to the test
        out = (rank, False, traceback.format_exc())
    q.put(out)
    if out[1]:
        _exit_together(world)
    os._exit(0)  # skip process-group destructors: a test about dead peers must not hang on them


def _exit_together(world: int, timeout: float = 10.0) -> None:
    """On NCCL, wait (through the store, at most ``timeout`` s) until every rank has finished its function.

    A rank's NCCL op is complete when its own part is, while its proxy may still be sending to a peer: a rank
    that exits then breaks the peer's op ("remote process exited"; seen on an H100 with ranks sharing it).
    Once every rank has returned, every op is complete on every rank. gloo's ops end with their data.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or "nccl" not in str(dist.get_backend()):
        return
    try:
        torch.cuda.synchronize()
        store = dist.distributed_c10d._get_default_store()
        store.add("tests_exit_together", 1)
        deadline = time.monotonic() + timeout
        while store.add("tests_exit_together", 0) < world and time.monotonic() < deadline:  # a rank may be gone
            time.sleep(0.01)
    except Exception:  # the store's host (rank 0) left first: everyone had arrived
        pass


def _context() -> Any:
    """Where rank processes come from: a fork server that imported torch and dapple once, so a rank skips those
    imports (a fresh interpreter, as with spawn, but seconds sooner); DAPPLE_TEST_START=spawn for plain spawn."""
    method = os.environ.get("DAPPLE_TEST_START", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "dapple", "tests.runtime.workers",
                                    "tests.hf.workers"])  # (a module that cannot be imported is left out)
    return ctx


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 150.0) -> list[Any]:
    """``fn(*args)`` on ``world`` processes; returns per-rank results, or raises with the failing tracebacks."""
    ctx = _context()
    q = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, q, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            if time.monotonic() > deadline:  # with what the others raised, often the cause
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results))} did not finish in {timeout}s"
                                   + "".join(f"\n--- rank {r} ---\n{v}" for r, (ok, v) in results.items() if not ok))
            if q.empty():
                for r, p in enumerate(procs):  # exited cleanly without a result (a test's vanishing rank)
                    if p.exitcode == 0 and r not in results and q.empty():
                        results[r] = (True, None)
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in results]  # a result first, then death: fine
                if dead and q.empty():
                    raise RuntimeError(f"ranks died without a result: {dead}")
                time.sleep(0.02)
                continue
            rank, ok, value = q.get()
            results[rank] = (ok, value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    failed = {r: v for r, (ok, v) in results.items() if not ok}
    if failed:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(failed.items())))
    return [results[r][1] for r in range(world)]


STALL_LIMIT = 90.0  # seconds a stalling rank waits at most for the others to report (well past any timeout here)


def stall_until_reported(key: str, others: int, limit: float = STALL_LIMIT) -> float:
    """Stall (as a stuck peer) until ``others`` ranks called :func:`reported` with ``key``, or ``limit`` seconds.

    A test that asserts "the others raised within the timeout, not when the peer came back" then bounds their time
    by ``limit``, however loaded the machine, instead of by a guess of how late a short stall may end. Returns
    the seconds stalled.
    """
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    start = time.monotonic()
    while time.monotonic() - start < limit:
        try:
            if store.add(key, 0) >= others:
                break
        except Exception:  # the store's host (rank 0) reported and left
            break
        time.sleep(0.05)
    return time.monotonic() - start


def reported(key: str) -> None:
    """Tell a rank stalling in :func:`stall_until_reported` that this one is done."""
    import torch.distributed as dist

    try:
        dist.distributed_c10d._get_default_store().add(key, 1)
    except Exception:  # the store's host (rank 0) already left: nobody is stalling on it any more
        pass
