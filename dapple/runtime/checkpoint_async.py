"""A checkpoint written in the background (``save_checkpoint(..., async_save=True)``): DCP writes a copy while
training goes on; it is marked complete and moved into place only once every rank's write is done."""

from __future__ import annotations

import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, cast
from weakref import WeakKeyDictionary

import torch.distributed as dist

from . import checkpoint_files as files
from .checkpoint_sync import all_or_none, attempt
from .engine import Pipeline
from .roll import gloo_world_group

_pending: "WeakKeyDictionary[Pipeline, AsyncSave]" = WeakKeyDictionary()


def writer_group(pipe: Pipeline, what: str) -> dist.ProcessGroup:
    """A gloo group of all ranks for the background writes' own collectives (DCP's plan exchange), apart from the
    group the ranks agree on, so that an agreement never meets a write in flight (made by the first async save:
    every rank must call it)."""
    return gloo_world_group(pipe, "background writes", pipe.who,
                            f"{what}: creating the gloo group of the background writes (did every rank call it?)")


class AsyncSave:
    """A checkpoint being written in the background, returned by ``save_checkpoint(..., async_save=True)``.

    What was saved is a copy taken when ``save_checkpoint`` returned: training may go on. Until :meth:`result`
    has run, the previous checkpoint is the one at ``path`` (a crash leaves it there).
    """

    def __init__(self, pipe: Pipeline, future: Future, finish: Callable[[BaseException | None], None], path: Path):
        self.path = path
        self._pipe, self._future, self._finish = pipe, future, finish
        self._outcome: tuple[BaseException | None] | None = None  # (error,) once result() ran

    def done(self) -> bool:
        """Whether this rank's write has ended (:meth:`result` then waits only for the other ranks)."""
        return self._future.done()

    def result(self) -> None:
        """Wait for this rank's write, then, as ``save_checkpoint`` ends: once every rank's part is on disk, mark the
        checkpoint complete and move it into place. Call on every rank (the next ``save_checkpoint`` or
        ``load_checkpoint`` of the pipeline does it first if you have not); a second call returns (or raises)
        as the first.

        Raises:
            RuntimeError, PipelineError: as ``save_checkpoint``: some rank's write failed (every rank raises,
                naming it; the previous checkpoint stays where it was), or a rank did not take part in time.
        """
        if self._outcome is None:
            if _pending.get(self._pipe) is self:
                del _pending[self._pipe]
            error = attempt(self._future.result)
            try:
                self._finish(error)
            except BaseException as e:
                self._outcome = (e,)
                raise
            self._outcome = (None,)
        elif self._outcome[0] is not None:
            raise self._outcome[0]

    def __repr__(self) -> str:
        state = "writing" if self._outcome is None and not self.done() else (
            "written" if self._outcome is None else "failed" if self._outcome[0] else "in place")
        return f"AsyncSave({str(self.path)!r}, {state})"


def write_in_background(pipe: Pipeline, group: dist.ProcessGroup, sd: dict[str, Any], *, writer: Any, planner: Any,
                        finish: Callable[[BaseException | None], None], target: Path, what: str) -> AsyncSave:
    """``dcp.async_save`` of ``sd`` with ``writer`` and ``planner``: a copy in host memory, written by a background
    thread (its collectives on a group of their own); every rank agrees on ``group`` that its write started
    before any returns. The handle's ``result()`` runs ``finish`` (the end of the save) with the write's outcome;
    the pipeline's next save or load does it first."""
    import torch.distributed.checkpoint as dcp  # (slow to import: on first use, as the rest of the checkpoints)
    future, error = None, None
    try:
        # a Future: torch returns an AsyncSaveResponse only to a caller that passes an async_stager
        future = cast(Future, dcp.async_save(sd, storage_writer=writer, planner=planner,
                                             process_group=writer_group(pipe, what)))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        error = e
    try:
        all_or_none(pipe, group, None, error, f"{what}: copying for the background write")
    except BaseException:
        if future is not None:  # this rank's write ends first (it waits for the others', which never come)
            attempt(future.result)
        if pipe.ctx.rank == 0:
            shutil.rmtree(files.saving(target), ignore_errors=True)
        raise
    if future is None:  # (all_or_none raised on every rank had the save failed on any)
        raise RuntimeError(f"{what}: no write in progress for {target} after async_save returned")
    handle = AsyncSave(pipe, future, finish, target)
    _pending[pipe] = handle
    return handle


def settle(pipe: Pipeline) -> None:
    """Before a save or load: finish the pipeline's background save if one is pending (its failure is raised here,
    on every rank)."""
    handle = _pending.get(pipe)
    if handle is not None:
        handle.result()
