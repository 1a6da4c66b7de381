"""Where each rank is: posted to the job's store before each collective, so a failed one names the ranks not there."""

# A post is one TCPStore ``set`` (a one-way message: about a microsecond); the store is read only after a failure.

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Sequence
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist

from ..core.dist import PipelineError, bounded, wait_for

KEY = "dapple/at/"  # + rank: "<who>\x1f<place>", this rank's last collective
SEP = "\x1f"
READ_SECONDS = 5.0  # at most this long per store read after a failure (a frozen store host must not add a timeout)
CLIP = "clip_grad_norm_"
_posted: list[Any] = [None]  # (store, what this rank last posted there): the same place is posted once


def _store() -> Any:
    """The default process group's store, or None (no group, or a torch without it)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def post(who: str, place: str) -> None:
    """Record that this rank (``who``, e.g. "rank 2 (stage 1)") has come to ``place`` (e.g. "step 3: loss
    AllReduce over all ranks"), the same words on every rank that comes there."""
    store = _store()
    value = f"{who}{SEP}{place}"
    if store is None or _posted[0] == (id(store), value):
        return
    try:
        store.set(f"{KEY}{dist.get_rank()}", value)
        _posted[0] = (id(store), value)
    except Exception:  # the store's host is gone: the collective will say so
        pass


def missing(place: str, ranks: Sequence[int]) -> str:
    """For an error at ``place``: "; <the ranks of ``ranks`` whose last post is elsewhere, and where>", or ""."""
    store = _store()
    if store is None:
        return ""
    old = store.timeout
    away = []
    try:
        store.set_timeout(timedelta(seconds=min(READ_SECONDS, old.total_seconds())))
        for r in ranks:
            key = f"{KEY}{r}"
            if not store.check([key]):
                away.append((f"rank {r}", "no collective of dapple yet (did it build its pipeline?)"))
                continue
            who, at = store.get(key).decode().split(SEP, 1)
            if at != place:
                away.append((who, f"'{at}'"))
    except Exception:  # the store is gone or stuck: say nothing rather than guess
        return ""
    finally:
        try:
            store.set_timeout(old)
        except Exception:
            pass
    if not away:
        return ""
    where = "; ".join(f"{who} is at {at}" for who, at in away[:8]) + (f"; ... ({len(away)} ranks)" if len(away) > 8
                                                                      else "")
    hint = ""
    if any(CLIP in at for _, at in away) or (CLIP in place):
        hint = f" (every rank must call {CLIP} after the same steps, or none)"
    return f"; not every rank came to it: {where}{hint}"


def called(timeout: float, who: str, place: str, ranks: Sequence[int], call: Callable[..., Any], /, *args: Any,
           **kwargs: Any) -> Any:
    """:func:`bounded` ``call`` (a blocking collective of ``ranks``, e.g. creating a group), posting ``place``
    first; a failure names the ranks that were elsewhere."""
    post(who, place)
    try:
        return bounded(timeout, f"{who}, {place}", call, *args, **kwargs)
    except PipelineError as e:
        raise PipelineError(f"{e}{missing(place, ranks)}") from e.__cause__


def waited(work: Any, timeout: float, who: str, place: str, ranks: Sequence[int],
           device: torch.device | None = None, detail: str = "") -> None:
    """:func:`wait_for` the collective ``work`` of ``ranks`` ("``who``, ``place````detail``" in its error), posting
    ``place`` first; a failure names the ranks that were elsewhere."""
    post(who, place)
    try:
        wait_for(work, timeout, f"{who}, {place}{detail}", device)
    except PipelineError as e:
        raise PipelineError(f"{e}{missing(place, ranks)}") from e.__cause__


_world_groups: "WeakKeyDictionary[Any, dict[str, dist.ProcessGroup]]" = WeakKeyDictionary()


def gloo_world_group(pipe: Any, purpose: str, who: str, place: str) -> dist.ProcessGroup:
    """A gloo group of every rank with ``pipe``'s timeout, one per ``purpose`` and pipeline (``pipe``: its
    ``timeout`` and ``ctx.world_size``), made by the first call for it: every rank must make it, in the same order;
    ``place`` says so in the error of a rank that waits for the others."""
    groups = _world_groups.setdefault(pipe, {})
    if purpose not in groups:
        world = pipe.ctx.world_size
        groups[purpose] = called(pipe.timeout, who, place, range(world), dist.new_group, list(range(world)),
                                 timeout=timedelta(seconds=pipe.timeout), backend="gloo")
    return groups[purpose]
