"""A save or load goes on only together: every rank's outcome is gathered on a gloo group, and one failure stops all."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from ..core.dist import PipelineError, first_line
from . import checkpoint_files as files
from .engine import Pipeline
from .roll import called, gloo_world_group


def checkpoint_group(pipe: Pipeline, what: str) -> dist.ProcessGroup:
    """A gloo group of all ranks with the pipeline's timeout, for DCP's object collectives (made once per pipe,
    by the first save or load: every rank must call it)."""
    return gloo_world_group(pipe, "checkpoints", pipe.who,
                            f"{what}: creating the gloo group of every rank (did every rank call it?)")


def attempt(call: Callable[..., Any], /, *args: Any, **kwargs: Any) -> BaseException | None:
    """Run ``call``; what it raised (torch.distributed.checkpoint raises ``CheckpointException``, a
    BaseException), or None. An interrupt or exit passes through."""
    try:
        call(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        return e
    return None


def describe_error(e: BaseException) -> str:
    """"Type: first line", or for DCP's CheckpointException each failing rank's."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"on rank {r}: {type(x[0]).__name__}: {first_line(x[0])}" for r, x in failures.items())
    return f"{type(e).__name__}: {first_line(e)}"


def all_or_none(pipe: Pipeline, group: dist.ProcessGroup, payload: Any, error: BaseException | None, what: str
                ) -> list[Any]:
    """All-gather every rank's payload or error (bounded by the pipeline's timeout); if any rank failed, every
    rank raises: this rank its own error (a ValueError or TypeError as it is, anything else as a RuntimeError
    naming the rank and stage), the others a PipelineError naming the failed rank, its stage and its error."""
    rank, world = pipe.ctx.rank, pipe.ctx.world_size
    who = f"rank {rank} (stage {pipe.stage})"
    out: list[Any] = [None] * world
    msg = None if error is None else describe_error(error)
    try:
        called(pipe.timeout, who, f"{what}: exchanging with every rank", range(world), dist.all_gather_object, out,
               (None if error else payload, msg), group=group)
    except PipelineError as e:
        if error is None:
            raise
        raise _own(error, who, what, f" (and the other ranks could not be told: {first_line(e)})") from error
    if error is not None:
        raise _own(error, who, what, "")
    failed = [(r, m) for r, (_, m) in enumerate(out) if m is not None]
    if failed:
        r0 = failed[0][0]
        more = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise PipelineError(f"{who}: {what} stopped because rank {r0} ({pipe.plan.device_label(r0)}) "
                            f"failed{more}: {failed[0][1]}")
    return [p for p, _ in out]


def _own(error: BaseException, who: str, what: str, note: str) -> BaseException:
    if isinstance(error, (ValueError, TypeError, FileNotFoundError)) and not note:
        return error
    return RuntimeError(f"{who}: {what} failed: {describe_error(error)}{note}")


def complete_save(pipe: Pipeline, group: dist.ProcessGroup, target: Path, tmp: Path, error: BaseException | None,
                  *, serial: int, step: int, what: str) -> None:
    """The end of a save, once this rank's write into ``tmp`` ended (``error``: how it failed, or None): every part
    is on disk, or every rank raises (and the incomplete write goes: the previous checkpoint was never touched);
    then rank 0 marks it complete (``serial``, ``step``) and moves it to ``target``; every rank returns once it is
    there."""
    try:
        all_or_none(pipe, group, None, error, f"{what}: writing")
    except BaseException:
        if pipe.ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if pipe.ctx.rank == 0:
        error = attempt(_mark_and_swap, target, tmp, serial, step)
    all_or_none(pipe, group, None, error, what)


def _mark_and_swap(target: Path, tmp: Path, serial: int, step: int) -> None:
    files.write_mark(tmp, serial, step)
    files.swap_in(target, tmp)
