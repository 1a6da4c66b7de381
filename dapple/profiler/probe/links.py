"""Bandwidth probe: P2P and AllReduce time fitted as latency + bytes / bandwidth, written as a Cluster."""

from __future__ import annotations

import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ...core.checks import is_int
from ...core.dist import barrier, bounded, free_port, timeout_seconds, wait_for
from .device import probe_device, synchronize
from .sharing import concurrent_sends

DEFAULT_SIZES = tuple(2 ** k for k in range(10, 25, 2))  # 1 KiB .. 16 MiB


def fit_line(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of seconds = latency + nbytes / bandwidth; returns (latency s, bandwidth B/s).

    Residuals are relative (weights 1 / seconds), so each size counts alike: the small sizes set the latency and
    the large ones the bandwidth (unweighted, the noise of the largest transfers would decide the intercept).
    """
    if len(nbytes) < 2 or len(set(nbytes)) < 2:
        raise ValueError(f"need at least two distinct sizes to fit latency and bandwidth, got {list(nbytes)}")
    y = np.asarray(seconds, float)
    slope, intercept = np.polyfit(np.asarray(nbytes, float), y, 1, w=1.0 / np.maximum(np.abs(y), 1e-12))
    if slope <= 0:
        raise ValueError(f"transfer time does not grow with size (times {list(seconds)} s for sizes "
                         f"{list(nbytes)} B): too noisy to fit; probe larger sizes or more repeats")
    return max(0.0, float(intercept)), float(1.0 / slope)


def check_probe(sizes: Sequence[int], repeats: int) -> None:
    """ValueError, before any process starts or byte moves, unless ``sizes`` holds two or more distinct positive
    byte counts (the fit needs two) and ``repeats`` is a positive integer."""
    if not is_int(repeats, 1):
        raise ValueError(f"repeats: expected a positive integer (timed transfers per size), got {repeats!r}")
    sizes = list(sizes)
    if any(not is_int(n, 1) for n in sizes) or len(set(sizes)) < 2:
        raise ValueError(f"sizes: expected two or more distinct positive byte counts (latency + bytes / bandwidth is "
                         f"fitted to them), got {sizes}")


def _wait(work, what: str, timeout: float) -> None:
    wait_for(work, timeout, f"bandwidth probe, rank {dist.get_rank()}: {what}")


def _barrier(device: torch.device, what: str, timeout: float, group=None) -> None:
    barrier(device, timeout, f"bandwidth probe, rank {dist.get_rank()}: barrier ({what})", group)


def _bounded(what: str, limit: float, call: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """A blocking step on a group whose timeout is ``limit`` seconds (creating a group, an object collective)."""
    return bounded(limit, f"bandwidth probe, rank {dist.get_rank()}: {what}", call, *args, **kwargs)


def ping_pong(peer_a: int, peer_b: int, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 7,
              timeout: float = 300.0) -> dict[int, float]:
    """One-way transfer seconds (median of half round trips) between two ranks; every rank must call it.
    Each round times every size once (see :func:`allreduce_times`); every wait is bounded by ``timeout``."""
    rank, device = dist.get_rank(), probe_device()
    bufs = {n: torch.empty(max(1, n // 4), dtype=torch.float32, device=device) for n in sizes}  # n bytes
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for i in range(repeats + 1):
        for n in sizes:
            buf = bufs[n]
            _barrier(device, f"before the {n}-byte ping-pong of ranks {peer_a} and {peer_b}", timeout)
            if rank == peer_a:
                synchronize(device)
                t0 = time.perf_counter()
                _wait(dist.isend(buf, peer_b), f"sending {n} bytes to rank {peer_b}", timeout)
                _wait(dist.irecv(buf, peer_b), f"receiving {n} bytes from rank {peer_b}", timeout)
                synchronize(device)
                if i:  # the first round trips set up the connection
                    times[n].append((time.perf_counter() - t0) / 2)
            elif rank == peer_b:
                _wait(dist.irecv(buf, peer_a), f"receiving {n} bytes from rank {peer_a}", timeout)
                _wait(dist.isend(buf, peer_a), f"sending {n} bytes to rank {peer_a}", timeout)
    return {n: statistics.median(t) for n, t in times.items()} if rank == peer_a else {}


def allreduce_times(sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 7, group=None,
                    timeout: float = 300.0) -> dict[int, float]:
    """Median seconds of an all_reduce(sum) of each size over ``group`` (default: all); its ranks call it.

    Each round times every size once, so a burst of load on a shared machine spreads over all sizes instead of
    slowing every repeat of one (which would bend the latency + bytes / bandwidth fit)."""
    device = probe_device()
    bufs = {n: torch.ones(max(1, n // 4), dtype=torch.float32, device=device) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for i in range(repeats + 1):
        for n in sizes:
            _barrier(device, f"before the {n}-byte AllReduce", timeout, group)
            synchronize(device)
            t0 = time.perf_counter()
            _wait(dist.all_reduce(bufs[n], group=group, async_op=True), f"the {n}-byte AllReduce", timeout)
            synchronize(device)
            if i:  # the first round sets up the connections
                times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def measure(sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 7, timeout: float = 300.0) -> dict:
    """Probe the links of an initialised process group (e.g. under torchrun); every rank calls it.

    Servers are told apart by host name (``DAPPLE_PROBE_HOST`` overrides it, e.g. to test several servers);
    ranks must be laid out server by server (torchrun's order).

    Args:
        sizes: byte counts every transfer and AllReduce is timed at (two or more distinct ones).
        repeats: timed rounds per measurement, after one untimed round.
        timeout: seconds for the groups it makes (a gloo one for the host names and the results) and every wait.

    Returns:
        The same dict on every rank: ``servers``, ``devices_per_server``, ``hosts``; ``intra`` / ``inter``:
        (latency s, bandwidth B/s) of a link inside a server / between servers (``inter`` None on one server);
        ``allreduce``: (latency per ring step, bus bandwidth) over all ranks; ``allreduce_intra``: the same inside
        server 0 (several servers of several devices); ``allreduce_by_size``: {r: fit} inside server 0 for
        r = 2, 4, 8 ... below its device count and for all of it; ``link_sharing``: {"intra" and/or "inter":
        :func:`~.sharing.concurrent_sends` from rank 0 to two ranks of its server / of the next server} (with 3
        or more ranks per server / 2 or more on each of 2 or more servers).
    """
    check_probe(sizes, repeats)
    wait = timedelta(seconds=timeout_seconds("timeout", timeout))
    world = dist.get_world_size()
    if world < 2:
        raise ValueError(f"the bandwidth probe needs at least 2 ranks, the world has {world}")
    objects = _bounded("creating its gloo group (does every rank call measure?)", timeout, dist.new_group,
                       list(range(world)), timeout=wait, backend="gloo")  # for the object collectives
    names, per = _servers(world, objects, timeout)
    result: dict = {"servers": len(names), "devices_per_server": per, "hosts": names, "inter": None}
    if per > 1:
        t = ping_pong(0, 1, sizes, repeats, timeout)
        result["intra"] = fit_line(list(t), list(t.values())) if t else None
    if len(names) > 1:
        t = ping_pong(0, per, sizes, repeats, timeout)
        result["inter"] = fit_line(list(t), list(t.values())) if t else None
    result["allreduce"] = _ring_fit(allreduce_times(sizes, repeats, timeout=timeout), world)
    if per > 1:
        _allreduces_in_server0(result, len(names), per, sizes, repeats, timeout, wait)
    if world >= 3:  # do two sends at once share the sender's link? (Cluster.link_sharing)
        sharing = {}
        if per >= 3:
            sharing["intra"] = concurrent_sends((1, 2), max(sizes), repeats, timeout)
        if len(names) > 1 and per >= 2:
            sharing["inter"] = concurrent_sends((per, per + 1), max(sizes), repeats, timeout)
        if sharing:
            result["link_sharing"] = sharing
    fits = [result]
    # rank 0 timed the ping-pongs: everyone gets its numbers
    _bounded("receiving rank 0's results", timeout, dist.broadcast_object_list, fits, 0, group=objects)
    return fits[0]


def server_name() -> str:
    """What tells this rank's server apart: ``DAPPLE_PROBE_HOST`` if set, else the host name, with torchrun's node
    rank (GROUP_RANK) when it launched several nodes (two nodes on one machine are two servers)."""
    if os.environ.get("DAPPLE_PROBE_HOST"):
        return os.environ["DAPPLE_PROBE_HOST"]
    node, nodes = os.environ.get("GROUP_RANK"), os.environ.get("GROUP_WORLD_SIZE")
    several = node is not None and (nodes is None or nodes != "1")
    return f"{socket.gethostname()} (node {node})" if several else socket.gethostname()


def _servers(world: int, objects: dist.ProcessGroup, timeout: float) -> tuple[list[str], int]:
    """(host names in rank order, ranks per server); ValueError unless ranks fill servers one after another."""
    hosts: list = [None] * world
    _bounded("gathering the host names", timeout, dist.all_gather_object, hosts, server_name(), group=objects)
    names = list(dict.fromkeys(hosts))
    per = hosts.count(names[0])
    expect = [h for h in names for _ in range(per)]
    if hosts != expect:
        raise ValueError(f"ranks must be laid out server by server with the same count on each (torchrun's "
                         f"order), got hosts by rank: {hosts}")
    return names, per


def _allreduces_in_server0(result: dict, servers: int, per: int, sizes: Sequence[int], repeats: int,
                           timeout: float, wait: timedelta) -> None:
    """Add ``allreduce_intra`` (several servers) and ``allreduce_by_size`` to ``result``: AllReduces inside
    server 0, as stages that do not span servers run them; the cost per byte may depend on the group size."""
    if servers > 1:
        server0 = _bounded("creating the group of server 0", timeout, dist.new_group, list(range(per)),
                           timeout=wait)  # every rank creates it, only server 0 uses it
        if dist.get_rank() < per:
            result["allreduce_intra"] = _ring_fit(allreduce_times(sizes, repeats, server0, timeout), per)
    by_size = {per: result.get("allreduce_intra") if servers > 1 else result["allreduce"]}  # rank 0's
    r = 2
    while r < per:
        group = _bounded(f"creating the group of ranks 0..{r - 1}", timeout, dist.new_group, list(range(r)),
                         timeout=wait)  # every rank creates it, ranks 0..r-1 use it
        if dist.get_rank() < r:
            by_size[r] = _ring_fit(allreduce_times(sizes, repeats, group, timeout), r)
        _barrier(probe_device(), f"after the AllReduce of ranks 0..{r - 1}", timeout)
        r *= 2
    result["allreduce_by_size"] = dict(sorted(by_size.items()))


def _ring_fit(times: dict[int, float], r: int) -> tuple[float, float]:
    """(latency per ring step s, bus bandwidth B/s): a ring AllReduce of n bytes over r ranks moves
    2(r-1)/r * n bytes over its slowest link in 2(r-1) latency-bound steps."""
    lat, bw = fit_line([2 * (r - 1) / r * n for n in times], list(times.values()))
    return lat / (2 * (r - 1)), bw


def _worker(rank: int, world: int, port: int, sizes: Sequence[int], repeats: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        fits = measure(sizes, repeats)
        if rank == 0:
            queue.put(fits)
        _barrier(probe_device(), "after the probe", 120.0)  # nobody closes its connections while a peer still reads
    except Exception as e:  # rank 0's own error (e.g. a noisy fit) reaches the caller, not just "peer closed"
        if rank == 0:
            queue.put(e)
        raise
    finally:
        dist.destroy_process_group()


def probe_local(world_size: int = 2, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 7) -> dict:
    """Start ``world_size`` gloo processes on this machine and :func:`measure` their links; rank 0's result."""
    if not is_int(world_size, 2):
        raise ValueError(f"probe_local: world_size must be an integer >= 2 to measure a link, got {world_size!r}")
    check_probe(sizes, repeats)
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    try:
        mp.start_processes(_worker, args=(world_size, port, tuple(sizes), repeats, queue), nprocs=world_size,
                           join=True, start_method="spawn")
    except Exception:
        if not queue.empty() and isinstance(err := queue.get(), Exception):
            raise err from None
        raise
    result = queue.get(timeout=10)
    if isinstance(result, Exception):
        raise result
    return result
