"""Distributed checkpoints of a Pipeline with torch.distributed.checkpoint, keyed by original names (any plan loads)."""

from __future__ import annotations

import io
import os
import shutil
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
from torch import nn

from .comm import PipelineError
from .engine import Pipeline

if TYPE_CHECKING:  # torch.distributed.checkpoint is imported on first use: it pulls in DTensor (~1 s)
    from torch.distributed.checkpoint.metadata import Metadata

FORMAT = 1
META = "dapple/meta"  # one object: format, step, versions, plan, tensor names, optimizer groups, extra
SAVING, REPLACED = ".saving", ".replaced"  # suffixes: the directory a save writes into / the one it replaces
_groups: "WeakKeyDictionary[Pipeline, dist.ProcessGroup]" = WeakKeyDictionary()


def _opt_key(name: str, state: str) -> str:
    """Checkpoint key of one optimizer state entry: the parameter's original name, not an optimizer index."""
    return f"optim/{name}/{state}"


@dataclass
class _Tensor:
    """One distinct tensor of this rank's stage."""

    key: str  # checkpoint key: a parameter's name in ``pipe.named_parameters()``; a buffer's smallest name
    kind: str  # "parameter" | "buffer"
    names: list[str]  # every name it has in the original model's state_dict (a tied one: several)
    tensor: torch.Tensor


# ---- public ------------------------------------------------------------------------------------
def save_checkpoint(path: str | os.PathLike, pipe: Pipeline, optimizer: torch.optim.Optimizer | None = None,
                    extra: Mapping[str, Any] | None = None) -> None:
    """Write this pipeline (all ranks call it) to the directory ``path`` with torch.distributed.checkpoint.

    Each rank writes its stage's parameters and buffers under their names in the original model, and the
    optimizer's state under the same names (``optim/<name>/<state>``), so any plan or world size can load
    it. Copies held by several ranks (stage replicas, stages sharing a tied parameter) are written once:
    DCP keeps one writer per key. Buffers come from replica 0 of their stage (replicas may differ, e.g.
    BatchNorm statistics; DDP likewise broadcasts rank 0's). Also stored: the plan, ``pipe.step``, the
    dapple and torch versions, the optimizer class and param-group hyperparameters, and ``extra`` (any
    picklable dict, e.g. the data position). The new checkpoint is written next to ``path`` and moved in
    place when complete, so an interrupted save leaves the previous one intact. Collectives run on a gloo
    group bounded by ``pipe.timeout``.
    """
    _check_args(pipe, optimizer)
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"extra: expected a dict (e.g. {{'data_position': 1200}}), got {type(extra).__name__}")
    extra = dict(extra or {})
    target = Path(os.path.abspath(path))
    tmp = target.with_name(target.name + SAVING)
    group, rank = _group(pipe), pipe.ctx.rank
    error, info = None, None
    try:
        local = _local_tensors(pipe)
        info = {"tensors": [(t.key, t.kind, t.names) for t in local],
                "optimizer": None if optimizer is None else _optimizer_info(optimizer, local)}
        if rank == 0:
            _prepare_target(target, tmp)
            torch.save(extra, io.BytesIO())  # picklable? fail before anything is written
    except Exception as e:
        error = e
    infos = _agree(pipe, group, info, error, f"save_checkpoint({str(target)!r})")
    has_opt = {r for r, i in enumerate(infos) if i["optimizer"] is not None}  # checked alike on every rank
    if has_opt and len(has_opt) != len(infos):
        raise ValueError(f"save_checkpoint: ranks {sorted(has_opt)} passed an optimizer, ranks "
                         f"{sorted(set(range(len(infos))) - has_opt)} did not (pass it on every rank or on none)")
    classes = sorted({i["optimizer"]["class"] for i in infos if i["optimizer"] is not None})
    if len(classes) > 1:
        raise ValueError(f"save_checkpoint: ranks use different optimizer classes {classes}")
    sd = _save_state(pipe, optimizer, local)
    if rank == 0:
        sd[META] = _meta(pipe, infos, extra)
    dcp = _dcp()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp), planner=_save_planner(), process_group=group)
    error = None
    if rank == 0:
        try:  # swap the complete new checkpoint in
            old = target.with_name(target.name + REPLACED)
            if target.exists():
                if old.exists():
                    shutil.rmtree(old)
                target.rename(old)
            tmp.rename(target)
            if old.exists():
                shutil.rmtree(old)
        except Exception as e:
            error = e
    _agree(pipe, group, None, error, f"save_checkpoint({str(target)!r})")  # returns once it is in place


def load_checkpoint(path: str | os.PathLike, pipe: Pipeline, optimizer: torch.optim.Optimizer | None = None
                    ) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``pipe`` (all ranks call it); returns ``extra``.

    The pipeline may use another plan or world size than the one that saved: each rank reads only the
    tensors of its own stage, by original name. ``optimizer`` (the same class as saved, over
    ``pipe.parameters()``) gets its per-parameter state and its param groups' hyperparameters back.
    ``pipe.step`` is set to the saved step. Checks run on every rank before anything is read, and if any
    rank finds a problem (missing path, not a dapple checkpoint, missing or unexpected tensors, shape
    mismatch, other optimizer) every rank raises, naming it. Collectives are bounded by ``pipe.timeout``.
    """
    _check_args(pipe, optimizer)
    target = Path(os.path.abspath(path))
    group = _group(pipe)
    error, finish = None, None
    sd: dict[str, Any] = {}
    meta: dict = {}
    try:
        md, meta = _read_meta(target)
        finish = _load_state(pipe, optimizer, target, md, meta, sd)
    except Exception as e:
        error = e
    _agree(pipe, group, None, error, f"load_checkpoint({str(target)!r})")
    dcp = _dcp()
    dcp.load(sd, storage_reader=dcp.FileSystemReader(target), planner=_load_planner(), process_group=group)
    finish()
    pipe.step = int(meta["step"])
    return dict(meta["extra"])


def load_full_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The original model's ``state_dict`` from a checkpoint, on one process without any process group.

    Every name the model's own ``state_dict`` has is present (a tied parameter under each of its names,
    as one tensor), so ``model.load_state_dict(load_full_state_dict(path))`` restores a plain model.
    Tensors are on the CPU, in the dtype they were saved in.
    """
    target = Path(os.path.abspath(path))
    md, meta = _read_meta(target)
    sd = {}
    for key in meta["tensors"]:
        m = md.state_dict_metadata.get(key)
        if not _is_tensor(m):
            raise ValueError(f"{target}: damaged dapple checkpoint: tensor {key!r} is listed but not stored")
        sd[key] = torch.empty(m.size, dtype=m.properties.dtype)  # filled in place by DCP
    _read(target, sd)
    key_of = {n: k for k, info in meta["tensors"].items() for n in info["names"]}
    return {name: sd[key_of[name]] for name in meta["state_dict_keys"]}


# ---- what a rank holds ---------------------------------------------------------------------------
def _check_args(pipe: Any, optimizer: Any) -> None:
    if not isinstance(pipe, Pipeline):
        raise TypeError(f"pipe: expected a dapple.Pipeline (from dapple.pipeline(...)), got {type(pipe).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}")


def _group(pipe: Pipeline) -> dist.ProcessGroup:
    """A gloo group of all ranks with the pipeline's timeout, for DCP's object collectives (made once per pipe)."""
    if pipe not in _groups:
        _groups[pipe] = dist.new_group(list(range(pipe.ctx.world_size)), timeout=timedelta(seconds=pipe.timeout),
                                       backend="gloo")
    return _groups[pipe]


def _aliases(pipe: Pipeline) -> tuple[dict[int, list[str]], list[str]]:
    """id(tensor) -> its names in the original model's state_dict, over ALL stages; and every name in order."""
    out: dict[int, list[str]] = {}
    order: list[str] = []
    for g in pipe.graphs:  # every rank holds every stage's (shared) modules
        for name, t in g.module.state_dict(keep_vars=True).items():
            names = out.setdefault(id(t), [])
            if name not in names:
                names.append(name)
                order.append(name)
    return out, order


def _local_tensors(pipe: Pipeline) -> list[_Tensor]:
    aliases, _ = _aliases(pipe)
    pname = {id(p): n for n, p in pipe.named_parameters()}
    out, seen = [], set()
    for name, t in pipe.module.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        names = aliases.get(id(t), [name])
        if isinstance(t, nn.Parameter):
            out.append(_Tensor(pname.get(id(t), name), "parameter", names, t))
        else:  # a buffer shared under several names: its smallest name, the same under any plan
            out.append(_Tensor(min(names), "buffer", names, t))
    return out


def _qualname(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _plain(v: Any) -> Any:
    return v.detach().cpu() if isinstance(v, torch.Tensor) else v


def _optimizer_info(optimizer: torch.optim.Optimizer, local: list[_Tensor]) -> dict:
    """Class, param groups (hyperparameters + parameter names) and state entry kinds, by original name."""
    key = {id(t.tensor): t.key for t in local if t.kind == "parameter"}
    groups, state = [], {}
    for i, group in enumerate(optimizer.param_groups):
        names = []
        for p in group["params"]:
            if id(p) not in key:
                raise ValueError(f"optimizer.param_groups[{i}] holds a tensor of shape {tuple(p.shape)} that is not "
                                 f"a parameter of this rank's stage (build the optimizer from pipe.parameters())")
            names.append(key[id(p)])
            state[key[id(p)]] = {k: "tensor" if isinstance(v, torch.Tensor) else "object"
                                 for k, v in optimizer.state.get(p, {}).items()}
        groups.append({"hyper": {k: _plain(v) for k, v in group.items() if k != "params"}, "params": names})
    return {"class": _qualname(optimizer), "param_groups": groups, "state": state}


def _save_state(pipe: Pipeline, optimizer: torch.optim.Optimizer | None, local: list[_Tensor]) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for t in local:
        if t.kind == "parameter" or pipe.replica == 0:
            sd[t.key] = t.tensor.detach()
    if optimizer is not None:
        key = {id(t.tensor): t.key for t in local}
        for group in optimizer.param_groups:
            for p in group["params"]:
                for k, v in optimizer.state.get(p, {}).items():
                    sd[_opt_key(key[id(p)], k)] = v.detach() if isinstance(v, torch.Tensor) else v
    return sd


def _meta(pipe: Pipeline, infos: list[dict], extra: dict) -> dict:
    """The checkpoint's description, merged on rank 0 from every rank's part."""
    import dapple

    _, order = _aliases(pipe)
    pos = {n: i for i, n in enumerate(order)}
    tensors: dict[str, dict] = {}
    for info in infos:
        for key, kind, names in info["tensors"]:
            tensors.setdefault(key, {"kind": kind, "names": list(names)})
    tensors = dict(sorted(tensors.items(), key=lambda kv: min(pos.get(n, len(pos)) for n in kv[1]["names"])))
    opt = None
    parts = [i["optimizer"] for i in infos if i["optimizer"] is not None]
    if parts:
        groups: dict[tuple, dict] = {}
        state: dict[str, dict] = {}
        for p in parts:
            for g in p["param_groups"]:
                groups.setdefault(tuple(g["params"]), g)  # replicas hold the same groups
            state.update(p["state"])
        opt = {"class": parts[0]["class"], "param_groups": list(groups.values()), "state": state}
    return {"format": FORMAT, "step": int(pipe.step), "dapple_version": dapple.__version__,
            "torch_version": str(torch.__version__), "world_size": pipe.ctx.world_size, "plan": pipe.plan.to_dict(),
            "tensors": tensors, "state_dict_keys": order, "optimizer": opt, "extra": extra}


# ---- loading ---------------------------------------------------------------------------------------
def _load_state(pipe: Pipeline, optimizer: torch.optim.Optimizer | None, path: Path, md: Metadata, meta: dict,
                sd: dict[str, Any]) -> Callable[[], None]:
    """Fill ``sd`` with this rank's destinations (checked); return what to do once DCP has read them."""
    tensors = meta["tensors"]
    key_of = {n: k for k, info in tensors.items() for n in info["names"]}
    local = _local_tensors(pipe)
    _, model_names = _aliases(pipe)
    where = f"stage {pipe.stage} (rank {pipe.ctx.rank})"
    missing, shapes, extra_copies, keys = [], [], [], {}
    for t in local:
        key = next((key_of[n] for n in [t.key, *t.names] if n in key_of), None)
        m = md.state_dict_metadata.get(key) if key is not None else None
        if not _is_tensor(m):
            missing.append(t.key)
            continue
        if tuple(m.size) != tuple(t.tensor.shape):
            shapes.append(f"{t.key}: checkpoint {tuple(m.size)}, this model {tuple(t.tensor.shape)}")
            continue
        keys[id(t.tensor)] = key
        if key in sd:  # two local tensors from one saved one (e.g. a tied checkpoint into an untied model)
            extra_copies.append((t.tensor, sd[key]))
        else:
            sd[key] = t.tensor.detach()
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} tensor(s) that {where} needs: {_few(missing)}; "
                         f"it holds {len(tensors)} such as {_few(list(tensors), 4)} (saved from another model?)")
    if shapes:
        raise ValueError(f"{path}: shape mismatch on {where}: {'; '.join(shapes[:6])}"
                         f"{' ...' if len(shapes) > 6 else ''} (saved from a model of another size?)")
    unused = [k for k, info in tensors.items() if not set(info["names"]) & set(model_names)]
    if unused:  # like load_state_dict(strict=True): nothing of the checkpoint may be left over
        raise ValueError(f"{path}: the checkpoint holds {len(unused)} tensor(s) this model lacks: {_few(unused)} "
                         f"(saved from another model?)")
    opt_done = _load_optimizer_state(optimizer, path, md, meta, keys, sd) if optimizer is not None else None

    def finish() -> None:
        with torch.no_grad():
            for dst, src in extra_copies:
                dst.copy_(src)
        if opt_done is not None:
            opt_done()
    return finish


def _load_optimizer_state(optimizer: torch.optim.Optimizer, path: Path, md: Metadata, meta: dict,
                          keys: dict[int, str], sd: dict[str, Any]) -> Callable[[], None]:
    om = meta["optimizer"]
    if om is None:
        raise ValueError(f"{path}: saved without optimizer state; load without an optimizer, or save with one")
    if om["class"] != _qualname(optimizer):
        raise ValueError(f"{path}: the optimizer state is for {om['class']}, the optimizer given is "
                         f"{_qualname(optimizer)}")
    hyper_of = {}
    for g in om["param_groups"]:
        for k in g["params"]:
            hyper_of.setdefault(k, g["hyper"])
    groups, entries = [], []  # entries[i]: (checkpoint key, state names) of optimizer index i
    for i, group in enumerate(optimizer.param_groups):
        hypers, first = [], len(entries)
        for p in group["params"]:
            key = keys.get(id(p))
            if key is None:
                raise ValueError(f"optimizer.param_groups[{i}] holds a tensor of shape {tuple(p.shape)} that is not "
                                 f"a parameter of this rank's stage (build the optimizer from pipe.parameters())")
            if key not in om["state"] or key not in hyper_of:
                raise ValueError(f"{path}: no optimizer state for parameter {key!r} (its optimizer did not hold it)")
            for s, kind in om["state"][key].items():
                k = _opt_key(key, s)
                m = md.state_dict_metadata.get(k)
                if kind == "tensor":
                    if not _is_tensor(m):
                        raise ValueError(f"{path}: damaged checkpoint: optimizer state {k!r} is listed but not stored")
                    sd.setdefault(k, torch.empty(m.size, dtype=m.properties.dtype))
                else:
                    sd.setdefault(k, None)  # an object: DCP puts it in place
            entries.append((key, list(om["state"][key])))
            hypers.append((key, hyper_of[key]))
        for key, h in hypers[1:]:
            if not _same(h, hypers[0][1]):
                diff = sorted(k for k in set(h) | set(hypers[0][1]) if not _same(h.get(k), hypers[0][1].get(k)))
                raise ValueError(f"optimizer.param_groups[{i}] mixes parameters saved in param groups with different "
                                 f"{diff}: {hypers[0][0]!r} and {key!r} (group them as when saving)")
        hyper = hypers[0][1] if hypers else {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": list(range(first, len(entries)))})

    def finish() -> None:
        used: set[str] = set()
        state = {}
        for i, (key, names) in enumerate(entries):
            st = {}
            for s in names:
                v = sd[_opt_key(key, s)]
                st[s] = v.clone() if isinstance(v, torch.Tensor) and key in used else v
            used.add(key)
            if st:
                state[i] = st
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    return finish


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
                         f"metadata ({_first_line(e)})") from None
    if META not in md.state_dict_metadata:
        raise ValueError(f"{path} is a torch.distributed.checkpoint checkpoint but not a dapple one (no {META!r} "
                         f"entry; it holds {_few(sorted(md.state_dict_metadata), 4)}); read it with dcp.load")
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
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path), planner=_load_planner(), no_dist=True)


# ---- helpers -------------------------------------------------------------------------------------
def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp
    return dcp


def _save_planner() -> Any:
    """Flat keys as given; a non-tensor value (the META dict, an optimizer's non-tensor state) is one object."""
    return _dcp().DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _load_planner() -> Any:
    """Tensors are read in place; objects are put into the very dict passed (flattening would copy it)."""
    return _dcp().DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _is_tensor(m: Any) -> bool:
    """DCP's metadata of a stored (whole) tensor, as opposed to an object or nothing."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    return isinstance(m, TensorStorageMetadata)


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
    msg = None if error is None else f"{type(error).__name__}: {_first_line(error)}"
    try:
        dist.all_gather_object(out, (None if error else payload, msg), group=group)
    except Exception as e:
        raise PipelineError(f"rank {rank} (stage {pipe.stage}): {what}: could not exchange with every rank within "
                            f"{pipe.timeout:g}s (did every rank call it?): {_first_line(e)}") from e
    if error is not None:
        raise error
    failed = [(r, m) for r, (_, m) in enumerate(out) if m is not None]
    if failed:
        more = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise PipelineError(f"rank {rank}: {what} stopped because rank {failed[0][0]} failed{more}: {failed[0][1]}")
    return [p for p, _ in out]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and bool(torch.equal(a.cpu(), b.cpu())))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _few(names: list[str], n: int = 6) -> str:
    return ", ".join(repr(x) for x in names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
