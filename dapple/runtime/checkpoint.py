"""Distributed checkpoints of a Pipeline with torch.distributed.checkpoint, keyed by original names (any plan loads)."""

from __future__ import annotations

import inspect
import io
import os
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.distributed as dist

from ..core.checks import flag
from ..core.dist import first_line
from . import checkpoint_files as files
from .checkpoint_async import AsyncSave, settle, write_in_background
from .checkpoint_loop import is_scheduler, load_scaler, rng_states, rng_targets, scheduler_state, scheduler_target
from .checkpoint_state import (
    FORMAT,
    StageTensor,
    describe,
    few,
    is_stored_tensor,
    load_targets,
    optimizer_info,
    save_state,
    stage_tensors,
)
from .checkpoint_sync import all_or_none, attempt, checkpoint_group, complete_save, describe_error
from .engine import Pipeline

if TYPE_CHECKING:  # torch.distributed.checkpoint is imported on first use: it pulls in DTensor, slow to import
    from torch.distributed.checkpoint.metadata import Metadata

META = "dapple/meta"  # one object: format, step, versions, plan, tensor names, optimizer groups, scaler, extra
SAVING, REPLACED = files.SAVING, files.REPLACED  # suffixes: the directory a save writes into / the one it replaces


# ---- public ------------------------------------------------------------------------------------
def save_checkpoint(path: str | os.PathLike, pipe: Pipeline, optimizer: torch.optim.Optimizer | None = None,
                    extra: Mapping[str, Any] | None = None, *, scheduler: Any = None,
                    async_save: bool = False) -> AsyncSave | None:
    """Write this pipeline (all ranks call it) to the directory ``path`` with torch.distributed.checkpoint.

    Each rank writes its stage's parameters and buffers under their names in the original model, and the
    optimizer's state under the same names (``optim/<name>/<state>``), so any plan or world size can load
    it (a :func:`dapple.shard_optimizer`'s state: each replica its share). Copies held by several ranks (stage
    replicas, stages sharing a tied parameter) are written once: DCP keeps one writer per key. Buffers come from
    replica 0 of their stage (replicas may differ, e.g. BatchNorm statistics; DDP likewise broadcasts rank 0's).
    Also stored: the plan, ``pipe.global_step``, the dapple and torch versions, the optimizer class and param-group
    hyperparameters, fp16's loss scale (``pipe.scaler``), the scheduler's state, each rank's random generator
    states, and ``extra``.

    The new checkpoint is written beside ``path`` (``path.saving``), marked complete once every rank's part is
    on disk, and swapped in atomically where the OS allows (Linux), else by two renames: at every instant the
    last complete checkpoint is at ``path`` or beside it, where :func:`load_checkpoint` finds it; none is
    removed before a newer one is in place. Collectives run on a gloo group bounded by ``pipe.timeout``.

    With ``async_save``, each rank copies what it saves to host memory and returns while ``dcp.async_save`` writes
    the copy in a background thread: training goes on. The returned :class:`AsyncSave`'s ``result()`` (on every
    rank; else the pipeline's next ``save_checkpoint`` or ``load_checkpoint`` does it first) waits for the writes
    and only then marks the checkpoint complete and moves it into place, raising any rank's write failure on
    every rank, as a synchronous save would. Call it before the job ends, or the last save is not in place.

    Args:
        path: the checkpoint directory; a dapple checkpoint already there is replaced, other files are not.
        pipe: this rank's pipeline.
        optimizer: an optimizer over ``pipe.parameters()`` whose state is saved too (pass one on every rank or
            on none).
        extra: any picklable dict saved with it (e.g. the data position); :func:`load_checkpoint` returns it.
        scheduler: an LR scheduler of ``optimizer`` whose state is saved too (on every rank or on none).
        async_save: write in the background (the same on every rank).

    Returns:
        None, or with ``async_save`` the :class:`AsyncSave` of the write in progress.

    Raises:
        ValueError: bad arguments or target, on every rank before anything is written.
        RuntimeError: writing failed on some rank (every rank raises, naming the rank, stage and its error;
            the previous checkpoint stays where it was).
        PipelineError: a rank did not take part within ``pipe.timeout``.
    """
    _check_args(pipe, optimizer, scheduler)
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"extra: expected a dict (e.g. {{'data_position': 1200}}), got {type(extra).__name__}")
    flag("async_save", async_save, "write in the background")
    extra = dict(extra or {})
    target = Path(os.path.abspath(path))
    tmp = files.saving(target)
    what = f"save_checkpoint({str(target)!r})"
    settle(pipe)  # a background save still pending is finished first (its failure raised here)
    group = checkpoint_group(pipe, what)
    local, infos = _describe_ranks(pipe, optimizer, scheduler, group, target, extra, what)
    sd = {**save_state(pipe, optimizer, local), **rng_states(pipe)}
    if pipe.ctx.rank == 0:
        sd[META] = {**describe(pipe, infos, extra), "scaler": pipe.scaler.state_dict(),
                    "scheduler": None if scheduler is None else scheduler_state(scheduler)}
    dcp = _dcp()
    writer = dcp.FileSystemWriter(tmp)
    finish = partial(complete_save, pipe, group, target, tmp, serial=infos[0]["serial"], step=pipe.global_step,
                     what=what)
    if async_save:  # a copy written in the background; finish() runs at AsyncSave.result()
        return write_in_background(pipe, group, sd, writer=writer, planner=_save_planner(), finish=finish,
                                   target=target, what=what)
    finish(attempt(dcp.save, sd, storage_writer=writer, planner=_save_planner(), process_group=group))
    return None


def _describe_ranks(pipe: Pipeline, optimizer: torch.optim.Optimizer | None, scheduler: Any,
                    group: dist.ProcessGroup, target: Path, extra: dict, what: str) -> tuple[list[StageTensor], list]:
    """This rank's tensors, and every rank's description of what it saves (checked alike on every rank; rank 0
    also prepares the target and tells the serial of the new save) before anything is written."""
    error: Exception | None = None
    info: dict[str, Any] | None = None
    local: list[StageTensor] = []
    try:
        local = stage_tensors(pipe)
        info = {"tensors": [(t.key, t.kind, t.names) for t in local],
                "optimizer": None if optimizer is None else optimizer_info(optimizer, local),
                "scheduler": scheduler is not None}
        if pipe.ctx.rank == 0:
            info["serial"] = _prepare_target(target)
            torch.save(extra, io.BytesIO())  # picklable? fail before anything is written
            if scheduler is not None:
                torch.save(scheduler_state(scheduler), io.BytesIO())
    except Exception as e:
        error = e
    infos = all_or_none(pipe, group, info, error, what)
    for name in ("optimizer", "scheduler"):
        given = {r for r, i in enumerate(infos) if i[name]}
        if given and len(given) != len(infos):
            raise ValueError(f"save_checkpoint: ranks {sorted(given)} passed {name}=, ranks "
                             f"{sorted(set(range(len(infos))) - given)} did not (pass it on every rank or on none)")
    classes = sorted({i["optimizer"]["class"] for i in infos if i["optimizer"] is not None})
    if len(classes) > 1:
        raise ValueError(f"save_checkpoint: ranks use different optimizer classes {classes}")
    return local, infos


def load_checkpoint(path: str | os.PathLike, pipe: Pipeline, optimizer: torch.optim.Optimizer | None = None, *,
                    scheduler: Any = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``pipe`` (all ranks call it).

    The pipeline may use another plan or world size than the one that saved: each rank reads only the
    tensors of its own stage, by original name. ``pipe.global_step`` is set to the saved step, and fp16's loss scale
    (``pipe.scaler``) to the saved one; under the same world size each rank's random generators continue where
    that rank's stopped (dropout draws what it would have drawn). If a save was interrupted, the newest complete
    checkpoint beside ``path`` is read (rank 0 warns). Checks run on every rank before anything is read (missing
    path, not a dapple checkpoint, missing or unexpected tensors, shape mismatch, other optimizer or scheduler,
    missing or truncated files), every rank reads into fresh buffers, and only once every rank has read its part
    does any rank change its state: if any rank fails, every rank raises, naming it, and none changed.
    Collectives are bounded by ``pipe.timeout``.

    Args:
        path: the checkpoint directory.
        pipe: this rank's pipeline (any plan for the same model).
        optimizer: an optimizer of the class saved, over ``pipe.parameters()``: it gets its per-parameter state
            and its param groups' hyperparameters back.
        scheduler: an LR scheduler of ``optimizer``, of the class saved: it gets its state back.

    Returns:
        The ``extra`` dict given to :func:`save_checkpoint`.
    """
    _check_args(pipe, optimizer, scheduler)
    target = Path(os.path.abspath(path))
    what = f"load_checkpoint({str(target)!r})"
    settle(pipe)  # a background save still pending is finished first (its failure raised here)
    group = checkpoint_group(pipe, what)
    error: BaseException | None = None
    found, finish, generators, schedule = files.Found(target, 0, None), _nothing, _nothing, None
    sd: dict[str, Any] = {}
    meta: dict = {}
    try:
        found = _find(target)
        md, meta = _read_meta(found.path)
        finish = load_targets(pipe, optimizer, found.path, md, meta, sd)  # fresh buffers, copied in by finish
        generators = rng_targets(pipe, md, meta, sd)
        schedule = None if scheduler is None else scheduler_target(scheduler, meta.get("scheduler"), found.path)
        files.check_shards(found.path, md.storage_data, set(sd), pipe.who)
    except Exception as e:
        error = e
    all_or_none(pipe, group, None, error, what)
    if found.path != target and pipe.ctx.rank == 0:
        state = "does not exist" if not target.exists() else "holds an older one"
        warnings.warn(f"load_checkpoint: {target} {state}: reading {found.path} (step {meta['step']}), the newest "
                      f"complete checkpoint there (a save was interrupted while moving it in place)", stacklevel=2)
    dcp = _dcp()
    error = attempt(dcp.load, sd, storage_reader=dcp.FileSystemReader(found.path), planner=_load_planner(),
                    process_group=group)
    all_or_none(pipe, group, None, error, f"{what}: reading")  # every rank read its part: only now does any change
    finish()
    generators()
    load_scaler(pipe, meta.get("scaler"))
    if schedule is not None:
        schedule()
    pipe.global_step = int(meta["step"])
    return dict(meta["extra"])


def load_full_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The original model's ``state_dict`` from a checkpoint, on one process without any process group.

    Args:
        path: a directory written by :func:`save_checkpoint` (if a save was interrupted, the newest complete
            checkpoint beside it).

    Returns:
        Every name the model's own ``state_dict`` has (a tied parameter under each of its names, as one tensor),
        so ``model.load_state_dict(load_full_state_dict(path))`` restores a plain model. Tensors are on the CPU,
        in the dtype they were saved in.
    """
    target = _find(Path(os.path.abspath(path))).path
    md, meta = _read_meta(target)
    sd = {}
    for key in meta["tensors"]:
        m = md.state_dict_metadata.get(key)
        if not is_stored_tensor(m):
            raise ValueError(f"{target}: damaged dapple checkpoint: tensor {key!r} is listed but not stored")
        sd[key] = torch.empty(m.size, dtype=m.properties.dtype)  # filled in place by DCP
    files.check_shards(target, md.storage_data, set(sd), "load_full_state_dict")
    error = attempt(_read, target, sd)
    if error is not None:
        raise ValueError(f"{target}: damaged checkpoint: {describe_error(error)}")
    key_of = {n: k for k, info in meta["tensors"].items() for n in info["names"]}
    return {name: sd[key_of[name]] for name in meta["state_dict_keys"]}


def _nothing() -> None:
    pass


def _find(target: Path) -> files.Found:
    """The newest complete checkpoint at or beside ``target``, else ``target`` itself if it exists (for the
    errors that say what it is); FileNotFoundError naming what lies beside it otherwise."""
    found = files.newest(target)
    if found is not None:
        return found
    if not target.exists():
        raise FileNotFoundError(files.missing_message(target))
    return files.Found(target, 0, None)


# ---- coordination ----------------------------------------------------------------------------------
def _check_args(pipe: Any, optimizer: Any, scheduler: Any) -> None:
    if not isinstance(pipe, Pipeline):
        raise TypeError(f"pipe: expected a dapple.Pipeline (from dapple.pipeline(...)), got {type(pipe).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")  # (imported by its users only)
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        raise TypeError("optimizer: torch's ZeroRedundancyOptimizer keeps its state in its shards, by index, and "
                        "saves it only consolidated on one rank; dapple.shard_optimizer(pipe, cls, ...) shards it the "
                        "same way and its checkpoints are by name (loadable under any plan)")
    if scheduler is not None and not is_scheduler(scheduler):
        raise TypeError(f"scheduler: expected an LR scheduler (torch.optim.lr_scheduler) or None, got "
                        f"{type(scheduler).__name__}")
    if scheduler is not None and optimizer is not None and scheduler.optimizer is not optimizer:
        raise ValueError("scheduler: it schedules another optimizer than the one given")


# ---- reading and writing --------------------------------------------------------------------------
def _read_meta(path: Path) -> tuple[Metadata, dict]:
    """DCP's metadata and dapple's description, read by this process alone; errors say what ``path`` is."""
    if not path.exists():
        raise FileNotFoundError(files.missing_message(path))
    if not path.is_dir():
        raise ValueError(f"{path} is not a dapple checkpoint: it is a file, dapple.save_checkpoint writes a directory")
    try:
        md = _dcp().FileSystemReader(path).read_metadata()
    except Exception as e:
        raise ValueError(f"{path} is not a dapple checkpoint: it has no readable torch.distributed.checkpoint "
                         f"metadata ({first_line(e)})") from None
    if META not in md.state_dict_metadata:
        raise ValueError(f"{path} is a torch.distributed.checkpoint checkpoint but not a dapple one (no {META!r} "
                         f"entry; it holds {few(sorted(md.state_dict_metadata), 4)}); read it with dcp.load")
    box: dict[str, Any] = {META: None}
    files.check_shards(path, md.storage_data, {META}, f"{path}: its description")
    error = attempt(_read, path, box)
    if error is not None:
        raise ValueError(f"{path}: damaged checkpoint: its description cannot be read ({describe_error(error)})")
    meta = box[META]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path}: dapple checkpoint format {got!r}, this dapple reads format {FORMAT}")
    return md, meta


def _read(path: Path, sd: dict[str, Any]) -> None:
    """DCP load into ``sd`` by this process alone (no collectives, whether or not a process group exists)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        dcp = _dcp()
        if "no_dist" in inspect.signature(dcp.load).parameters:
            dcp.load(sd, storage_reader=dcp.FileSystemReader(path), planner=_load_planner(), no_dist=True)
        else:  # torch < 2.5: only the loader behind dcp.load takes no_dist (same call, 2.4 .. 2.13); lazy as _dcp
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
            _load_state_dict(sd, dcp.FileSystemReader(path), planner=_load_planner(), no_dist=True)


def _dcp() -> Any:
    """torch.distributed.checkpoint, imported on first use (it pulls in DTensor: slow, and only checkpoints need
    it)."""
    import torch.distributed.checkpoint as dcp
    return dcp


def _save_planner() -> Any:
    """Flat keys as given; a non-tensor value (the META dict, an optimizer's non-tensor state) is one object."""
    return _dcp().DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _load_planner() -> Any:
    """Tensors are read in place; objects are put into the very dict passed (flattening would copy it)."""
    return _dcp().DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _prepare_target(target: Path) -> int:
    """Rank 0, before any write: refuse to replace what is not a dapple checkpoint; make the newest complete
    checkpoint the target (an interrupted save's), clear the rest beside it; the new save's serial."""
    if target.exists():
        if not target.is_dir():
            raise ValueError(f"save_checkpoint: {target} exists and is a file; give a directory path")
        if any(target.iterdir()):
            try:
                _read_meta(target)
            except (ValueError, FileNotFoundError):
                raise ValueError(f"save_checkpoint: {target} holds files but is not a dapple checkpoint; refusing to "
                                 f"replace it (give a new or empty directory)") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    return files.promote(target)
