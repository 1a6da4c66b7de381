"""What each rank of a checkpointed Pipeline holds, by original name: stage tensors, optimizer state and groups."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeGuard

import torch
from torch import nn

from ..core.version import VERSION
from .engine import Pipeline
from .sharding import ShardedOptimizer

if TYPE_CHECKING:  # torch.distributed.checkpoint is imported on first use
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

FORMAT = 1  # version of the description ``describe`` writes


def opt_key(name: str, state: str) -> str:
    """Checkpoint key of one optimizer state entry: the parameter's original name, not an optimizer index."""
    return f"optim/{name}/{state}"


@dataclass(frozen=True)
class StageTensor:
    """One distinct tensor of this rank's stage."""

    key: str  # checkpoint key: a parameter's name in ``pipe.named_parameters()``; a buffer's smallest name
    kind: str  # "parameter" | "buffer"
    names: list[str]  # every name it has in the original model's state_dict (a tied one: several)
    tensor: torch.Tensor


def stage_tensors(pipe: Pipeline) -> list[StageTensor]:
    """This rank's stage parameters and buffers, each once, with their checkpoint keys and all their names."""
    aliases = pipe.state_names  # id(tensor) -> its names in the original model's state_dict
    pname = {id(p): n for n, p in pipe.named_parameters()}
    out, seen = [], set()
    for name, t in pipe.module.state_dict(keep_vars=True).items():
        if id(t) in seen or id(t) not in aliases:  # not in the model's state_dict: a non-persistent buffer
            continue
        seen.add(id(t))
        names = aliases[id(t)]
        if isinstance(t, nn.Parameter):
            out.append(StageTensor(pname.get(id(t), name), "parameter", names, t))
        else:  # a buffer shared under several names: its smallest name, the same under any plan
            out.append(StageTensor(min(names), "buffer", names, t))
    return out


def qualname(optimizer: torch.optim.Optimizer) -> str:
    """``torch.optim.adamw.AdamW``: what a checkpoint's optimizer state is for (a sharded optimizer's: the class
    it runs on its shard, so that sharded and unsharded runs load each other's checkpoints)."""
    kind = optimizer.optimizer_class if isinstance(optimizer, ShardedOptimizer) else type(optimizer)
    return f"{kind.__module__}.{kind.__qualname__}"


def holds_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    """Whether ``optimizer`` keeps ``p``'s state on this rank (a sharded one: only for the parameters it owns)."""
    return optimizer.owns(p) if isinstance(optimizer, ShardedOptimizer) else True


def _plain(v: Any) -> Any:
    return v.detach().cpu() if isinstance(v, torch.Tensor) else v


def _foreign(i: int, p: torch.Tensor) -> ValueError:
    return ValueError(f"optimizer.param_groups[{i}] holds a tensor of shape {tuple(p.shape)} that is not a parameter "
                      f"of this rank's stage (build the optimizer from pipe.parameters())")


def optimizer_info(optimizer: torch.optim.Optimizer, local: list[StageTensor]) -> dict:
    """Class, param groups (hyperparameters + parameter names) and state entry kinds, by original name."""
    key = {id(t.tensor): t.key for t in local if t.kind == "parameter"}
    groups, state = [], {}
    for i, group in enumerate(optimizer.param_groups):
        names = []
        for p in group["params"]:
            if id(p) not in key:
                raise _foreign(i, p)
            names.append(key[id(p)])
            state[key[id(p)]] = {k: "tensor" if isinstance(v, torch.Tensor) else "object"
                                 for k, v in optimizer.state.get(p, {}).items()}
        groups.append({"hyper": {k: _plain(v) for k, v in group.items() if k != "params"}, "params": names})
    return {"class": qualname(optimizer), "param_groups": groups, "state": state}


def save_state(pipe: Pipeline, optimizer: torch.optim.Optimizer | None, local: list[StageTensor]) -> dict[str, Any]:
    """What this rank hands to DCP: its tensors (buffers on replica 0 only) and optimizer state, by name."""
    sd: dict[str, Any] = {}
    for t in local:
        if t.kind == "parameter" or pipe.replica == 0:
            sd[t.key] = t.tensor.detach()
    if optimizer is not None:
        key = {id(t.tensor): t.key for t in local}
        for group in optimizer.param_groups:
            for p in group["params"]:
                for k, v in optimizer.state.get(p, {}).items():
                    sd[opt_key(key[id(p)], k)] = v.detach() if isinstance(v, torch.Tensor) else v
    return sd


def describe(pipe: Pipeline, infos: list[dict], extra: dict) -> dict:
    """The checkpoint's description, merged on rank 0 from every rank's part."""

    order = pipe.state_order  # every name of the original model's state_dict, in order
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
            for key, kinds in p["state"].items():  # a sharded optimizer's owner lists the state, the others none
                if kinds or key not in state:
                    state[key] = kinds
        opt = {"class": parts[0]["class"], "param_groups": list(groups.values()), "state": state}
    return {"format": FORMAT, "step": int(pipe.global_step), "dapple_version": VERSION,
            "torch_version": str(torch.__version__), "world_size": pipe.ctx.world_size, "plan": pipe.plan.to_dict(),
            "tensors": tensors, "state_dict_keys": order, "optimizer": opt, "extra": extra}


def load_targets(pipe: Pipeline, optimizer: torch.optim.Optimizer | None, path: Path, md: Metadata, meta: dict,
                 sd: dict[str, Any]) -> Callable[[], None]:
    """Fill ``sd`` with this rank's destinations (checked; fresh buffers: the stage is untouched until ``finish``);
    return what copies them in once DCP has read them."""
    tensors = meta["tensors"]
    key_of = {n: k for k, info in tensors.items() for n in info["names"]}
    local = stage_tensors(pipe)
    all_names = set(pipe.state_order)
    where = f"stage {pipe.stage} (rank {pipe.ctx.rank})"
    missing: list[str] = []
    shapes: list[str] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    keys: dict[int, str] = {}
    for t in local:
        key = next((key_of[n] for n in [t.key, *t.names] if n in key_of), None)
        m = md.state_dict_metadata.get(key) if key is not None else None
        if key is None or not is_stored_tensor(m):
            missing.append(t.key)
            continue
        if tuple(m.size) != tuple(t.tensor.shape):
            shapes.append(f"{t.key}: checkpoint {tuple(m.size)}, this model {tuple(t.tensor.shape)}")
            continue
        keys[id(t.tensor)] = key
        # read into a fresh buffer, copied into the stage by ``finish`` once every rank has read its part
        copies.append((t.tensor, sd.setdefault(key, torch.empty(m.size, dtype=m.properties.dtype))))
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} tensor(s) that {where} needs: {few(missing)}; "
                         f"it holds {len(tensors)} such as {few(list(tensors), 4)} (saved from another model?)")
    if shapes:
        raise ValueError(f"{path}: shape mismatch on {where}: {'; '.join(shapes[:6])}"
                         f"{' ...' if len(shapes) > 6 else ''} (saved from a model of another size?)")
    unused = [k for k, info in tensors.items() if all_names.isdisjoint(info["names"])]
    if unused:  # like load_state_dict(strict=True): nothing of the checkpoint may be left over
        raise ValueError(f"{path}: the checkpoint holds {len(unused)} tensor(s) this model lacks: {few(unused)} "
                         f"(saved from another model?)")
    opt_done = _optimizer_targets(optimizer, path, md, meta, keys, sd) if optimizer is not None else None

    def finish() -> None:
        with torch.no_grad():
            for dst, src in copies:  # (two local tensors may come from one saved one: a tied checkpoint, untied)
                dst.copy_(src)
        if opt_done is not None:
            opt_done()
    return finish


def _optimizer_targets(optimizer: torch.optim.Optimizer, path: Path, md: Metadata, meta: dict,
                       keys: dict[int, str], sd: dict[str, Any]) -> Callable[[], None]:
    """Destinations for the saved state of this optimizer's parameters (by name; a sharded optimizer's: of those
    this rank owns); ``finish`` maps them back to its own parameter order and param groups through
    ``optimizer.load_state_dict``."""
    om = meta["optimizer"]
    if om is None:
        raise ValueError(f"{path}: saved without optimizer state; load without an optimizer, or save with one")
    if om["class"] != qualname(optimizer):
        raise ValueError(f"{path}: the optimizer state is for {om['class']}, the optimizer given is "
                         f"{qualname(optimizer)}")
    hyper_of: dict[str, dict] = {}
    for g in om["param_groups"]:
        for k in g["params"]:
            hyper_of.setdefault(k, g["hyper"])
    groups: list[dict] = []
    entries: list[tuple[str, list[str]]] = []  # entries[i]: (checkpoint key, state names) of optimizer index i
    for i, group in enumerate(optimizer.param_groups):
        hypers, first = [], len(entries)
        for p in group["params"]:
            key = keys.get(id(p))
            if key is None:
                raise _foreign(i, p)
            if key not in om["state"] or key not in hyper_of:
                raise ValueError(f"{path}: no optimizer state for parameter {key!r} (its optimizer did not hold it)")
            kinds = om["state"][key] if holds_state(optimizer, p) else {}  # (its owner reads it)
            _state_destinations(path, md, key, kinds, sd)
            entries.append((key, list(kinds)))
            hypers.append((key, hyper_of[key]))
        hyper = _one_hyper(i, hypers) if hypers else {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": list(range(first, len(entries)))})

    def finish() -> None:
        used: set[str] = set()
        state = {}
        for i, (key, names) in enumerate(entries):
            st = {}
            for s in names:
                v = sd[opt_key(key, s)]
                st[s] = v.clone() if isinstance(v, torch.Tensor) and key in used else v
            used.add(key)
            if st:
                state[i] = st
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    return finish


def _state_destinations(path: Path, md: Metadata, key: str, kinds: dict[str, str], sd: dict[str, Any]) -> None:
    """Put a destination for each saved state entry of parameter ``key`` into ``sd`` (``kinds``: state name ->
    "tensor" | "object"): an empty tensor DCP fills in place, or None for an object DCP puts there."""
    for s, kind in kinds.items():
        k = opt_key(key, s)
        m = md.state_dict_metadata.get(k)
        if kind == "tensor":
            if not is_stored_tensor(m):
                raise ValueError(f"{path}: damaged checkpoint: optimizer state {k!r} is listed but not stored")
            sd.setdefault(k, torch.empty(m.size, dtype=m.properties.dtype))
        else:
            sd.setdefault(k, None)


def _one_hyper(i: int, hypers: list[tuple[str, dict]]) -> dict:
    """The hyperparameters saved for the parameters of ``optimizer.param_groups[i]`` (``hypers``: per parameter,
    its key and saved group's hyperparameters); ValueError if they came from groups that differ."""
    for key, h in hypers[1:]:
        if not same(h, hypers[0][1]):
            diff = sorted(k for k in set(h) | set(hypers[0][1]) if not same(h.get(k), hypers[0][1].get(k)))
            raise ValueError(f"optimizer.param_groups[{i}] mixes parameters saved in param groups with different "
                             f"{diff}: {hypers[0][0]!r} and {key!r} (group them as when saving)")
    return hypers[0][1]


def is_stored_tensor(m: Any) -> TypeGuard[TensorStorageMetadata]:
    """DCP's metadata of a stored (whole) tensor, as opposed to an object or nothing."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # DCP is slow to import: on first use
    return isinstance(m, TensorStorageMetadata)


def same(a: Any, b: Any) -> bool:
    """Equality of hyperparameter values that may be tensors, tuples or dicts."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and bool(torch.equal(a.cpu(), b.cpu())))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def few(names: list[str], n: int = 6) -> str:
    """The first ``n`` names for an error message, and how many there are."""
    return ", ".join(repr(x) for x in names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")
