"""Distributed checkpoints of a Pipeline with torch.distributed.checkpoint, keyed by original names (any plan loads)."""

from __future__ import annotations

import inspect
import io
import os
import shutil
import warnings
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist

from ..core.dist import PipelineError, bounded, first_line
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
from .engine import Pipeline

if TYPE_CHECKING:  # torch.distributed.checkpoint is imported on first use: it pulls in DTensor, slow to import
    from torch.distributed.checkpoint.metadata import Metadata

META = "dapple/meta"  # one object: format, step, versions, plan, tensor names, optimizer groups, extra
SAVING, REPLACED = ".saving", ".replaced"  # suffixes: the directory a save writes into / the one it replaces
_groups: "WeakKeyDictionary[Pipeline, dist.ProcessGroup]" = WeakKeyDictionary()


# ---- public ------------------------------------------------------------------------------------
def save_checkpoint(path: str | os.PathLike, pipe: Pipeline, optimizer: torch.optim.Optimizer | None = None,
                    extra: Mapping[str, Any] | None = None) -> None:
    """Write this pipeline (all ranks call it) to the directory ``path`` with torch.distributed.checkpoint.

    Each rank writes its stage's parameters and buffers under their names in the original model, and the
    optimizer's state under the same names (``optim/<name>/<state>``), so any plan or world size can load
    it. Copies held by several ranks (stage replicas, stages sharing a tied parameter) are written once:
    DCP keeps one writer per key. Buffers come from replica 0 of their stage (replicas may differ, e.g.
    BatchNorm statistics; DDP likewise broadcasts rank 0's). Also stored: the plan, ``pipe.step``, the
    dapple and torch versions, the optimizer class and param-group hyperparameters, and ``extra``. The new
    checkpoint is written next to ``path`` and moved in place when complete, so an interrupted save leaves the
    previous one intact. Collectives run on a gloo group bounded by ``pipe.timeout``.

    Args:
        path: the checkpoint directory; a dapple checkpoint already there is replaced, other files are not.
        pipe: this rank's pipeline.
        optimizer: an optimizer over ``pipe.parameters()`` whose state is saved too (pass one on every rank or
            on none).
        extra: any picklable dict saved with it (e.g. the data position); :func:`load_checkpoint` returns it.
    """
    _check_args(pipe, optimizer)
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"extra: expected a dict (e.g. {{'data_position': 1200}}), got {type(extra).__name__}")
    extra = dict(extra or {})
    target = Path(os.path.abspath(path))
    tmp = target.with_name(target.name + SAVING)
    what = f"save_checkpoint({str(target)!r})"
    group = _group(pipe, what)
    local, infos = _describe_ranks(pipe, optimizer, group, target, tmp, extra, what)
    sd = save_state(pipe, optimizer, local)
    if pipe.ctx.rank == 0:
        sd[META] = describe(pipe, infos, extra)
    dcp = _dcp()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp), planner=_save_planner(), process_group=group)
    error = _swap_in(target, tmp) if pipe.ctx.rank == 0 else None
    _agree(pipe, group, None, error, what)  # returns once it is in place


def _describe_ranks(pipe: Pipeline, optimizer: torch.optim.Optimizer | None, group: dist.ProcessGroup,
                    target: Path, tmp: Path, extra: dict, what: str) -> tuple[list[StageTensor], list[dict]]:
    """This rank's tensors, and every rank's description of what it saves (checked alike on every rank; rank 0
    also prepares the target) before anything is written."""
    error, info, local = None, None, []
    try:
        local = stage_tensors(pipe)
        info = {"tensors": [(t.key, t.kind, t.names) for t in local],
                "optimizer": None if optimizer is None else optimizer_info(optimizer, local)}
        if pipe.ctx.rank == 0:
            _prepare_target(target, tmp)
            torch.save(extra, io.BytesIO())  # picklable? fail before anything is written
    except Exception as e:
        error = e
    infos = _agree(pipe, group, info, error, what)
    has_opt = {r for r, i in enumerate(infos) if i["optimizer"] is not None}
    if has_opt and len(has_opt) != len(infos):
        raise ValueError(f"save_checkpoint: ranks {sorted(has_opt)} passed an optimizer, ranks "
                         f"{sorted(set(range(len(infos))) - has_opt)} did not (pass it on every rank or on none)")
    classes = sorted({i["optimizer"]["class"] for i in infos if i["optimizer"] is not None})
    if len(classes) > 1:
        raise ValueError(f"save_checkpoint: ranks use different optimizer classes {classes}")
    return local, infos


def _swap_in(target: Path, tmp: Path) -> Exception | None:
    """Rank 0: move the complete new checkpoint ``tmp`` to ``target`` (the old one aside, then removed); the
    error, if any, for every rank to raise."""
    try:
        old = target.with_name(target.name + REPLACED)
        if target.exists():
            if old.exists():
                shutil.rmtree(old)
            target.rename(old)
        tmp.rename(target)
        if old.exists():
            shutil.rmtree(old)
    except Exception as e:
        return e
    return None


def load_checkpoint(path: str | os.PathLike, pipe: Pipeline, optimizer: torch.optim.Optimizer | None = None
                    ) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``pipe`` (all ranks call it).

    The pipeline may use another plan or world size than the one that saved: each rank reads only the
    tensors of its own stage, by original name. ``pipe.step`` is set to the saved step. Checks run on every
    rank before anything is read, and if any rank finds a problem (missing path, not a dapple checkpoint,
    missing or unexpected tensors, shape mismatch, other optimizer) every rank raises, naming it. Collectives
    are bounded by ``pipe.timeout``.

    Args:
        path: the checkpoint directory.
        pipe: this rank's pipeline (any plan for the same model).
        optimizer: an optimizer of the class saved, over ``pipe.parameters()``: it gets its per-parameter state
            and its param groups' hyperparameters back.

    Returns:
        The ``extra`` dict given to :func:`save_checkpoint`.
    """
    _check_args(pipe, optimizer)
    target = Path(os.path.abspath(path))
    what = f"load_checkpoint({str(target)!r})"
    group = _group(pipe, what)
    error, finish = None, None
    sd: dict[str, Any] = {}
    meta: dict = {}
    try:
        md, meta = _read_meta(target)
        finish = load_targets(pipe, optimizer, target, md, meta, sd)
    except Exception as e:
        error = e
    _agree(pipe, group, None, error, what)
    dcp = _dcp()
    dcp.load(sd, storage_reader=dcp.FileSystemReader(target), planner=_load_planner(), process_group=group)
    finish()
    pipe.step = int(meta["step"])
    return dict(meta["extra"])


def load_full_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The original model's ``state_dict`` from a checkpoint, on one process without any process group.

    Args:
        path: a directory written by :func:`save_checkpoint`.

    Returns:
        Every name the model's own ``state_dict`` has (a tied parameter under each of its names, as one tensor),
        so ``model.load_state_dict(load_full_state_dict(path))`` restores a plain model. Tensors are on the CPU,
        in the dtype they were saved in.
    """
    target = Path(os.path.abspath(path))
    md, meta = _read_meta(target)
    sd = {}
    for key in meta["tensors"]:
        m = md.state_dict_metadata.get(key)
        if not is_stored_tensor(m):
            raise ValueError(f"{target}: damaged dapple checkpoint: tensor {key!r} is listed but not stored")
        sd[key] = torch.empty(m.size, dtype=m.properties.dtype)  # filled in place by DCP
    _read(target, sd)
    key_of = {n: k for k, info in meta["tensors"].items() for n in info["names"]}
    return {name: sd[key_of[name]] for name in meta["state_dict_keys"]}


# ---- coordination ----------------------------------------------------------------------------------
def _check_args(pipe: Any, optimizer: Any) -> None:
    if not isinstance(pipe, Pipeline):
        raise TypeError(f"pipe: expected a dapple.Pipeline (from dapple.pipeline(...)), got {type(pipe).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}")


def _group(pipe: Pipeline, what: str) -> dist.ProcessGroup:
    """A gloo group of all ranks with the pipeline's timeout, for DCP's object collectives (made once per pipe,
    by the first save or load: every rank must call it)."""
    if pipe not in _groups:
        _groups[pipe] = bounded(pipe.timeout, f"rank {pipe.ctx.rank} (stage {pipe.stage}): {what}: creating the "
                                f"gloo group of every rank (did every rank call it?)", dist.new_group,
                                list(range(pipe.ctx.world_size)), timeout=timedelta(seconds=pipe.timeout),
                                backend="gloo")
    return _groups[pipe]


# ---- reading and writing --------------------------------------------------------------------------
def _read_meta(path: Path) -> tuple[Metadata, dict]:
    """DCP's metadata and dapple's description, read by this process alone; errors say what ``path`` is."""
    if not path.exists():
        hint = ""
        for suffix, what in ((REPLACED, "the previous checkpoint"), (SAVING, "an incomplete save")):
            if path.with_name(path.name + suffix).exists():
                hint = f" ({path.name}{suffix} holds {what}: a save was interrupted)"
        raise FileNotFoundError(f"no checkpoint at {path}: the path does not exist{hint}")
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
    _read(path, box)
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


def _prepare_target(target: Path, tmp: Path) -> None:
    """Rank 0, before any write: refuse to replace what is not a dapple checkpoint; clear a stale save."""
    if target.exists():
        if not target.is_dir():
            raise ValueError(f"save_checkpoint: {target} exists and is a file; give a directory path")
        if any(target.iterdir()):
            try:
                _read_meta(target)
            except (ValueError, FileNotFoundError):
                raise ValueError(f"save_checkpoint: {target} holds files but is not a dapple checkpoint; refusing to "
                                 f"replace it (give a new or empty directory)") from None
    if tmp.exists():
        shutil.rmtree(tmp)  # left by an interrupted save (its name is ours)
    tmp.parent.mkdir(parents=True, exist_ok=True)


def _agree(pipe: Pipeline, group: dist.ProcessGroup, payload: Any, error: BaseException | None, what: str
           ) -> list[Any]:
    """All-gather every rank's payload or error (bounded by the group's timeout); if any failed, all raise."""
    rank = pipe.ctx.rank
    out: list[Any] = [None] * pipe.ctx.world_size
    msg = None if error is None else f"{type(error).__name__}: {first_line(error)}"
    try:
        dist.all_gather_object(out, (None if error else payload, msg), group=group)
    except Exception as e:
        raise PipelineError(f"rank {rank} (stage {pipe.stage}): {what}: could not exchange with every rank within "
                            f"{pipe.timeout:g}s (did every rank call it?): {first_line(e)}") from e
    if error is not None:
        raise error
    failed = [(r, m) for r, (_, m) in enumerate(out) if m is not None]
    if failed:
        more = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise PipelineError(f"rank {rank}: {what} stopped because rank {failed[0][0]} failed{more}: {failed[0][1]}")
    return [p for p, _ in out]
