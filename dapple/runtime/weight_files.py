"""Reading named tensors from checkpoint files without reading the rest: safetensors (one file or an index of
shards), ``torch.save`` state dicts, and torch.distributed.checkpoint directories (dapple's own, or plain)."""

from __future__ import annotations

import inspect
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors import safe_open

from .checkpoint import META

SAFETENSORS_INDEX, SAFETENSORS = "model.safetensors.index.json", "model.safetensors"
TORCH_INDEX, TORCH_BIN = "pytorch_model.bin.index.json", "pytorch_model.bin"  # older transformers checkpoints
# a shard is memory-mapped while open, and the pages read count in the process's resident memory until it is closed:
# reopening it after every this many bytes read keeps that bounded, whatever the stage's size
READ_BYTES = 256 << 20


@dataclass
class Stored:
    """Where a checkpoint keeps one tensor: its file (or directory) and the key it is stored under there."""

    file: str
    key: str
    shape: tuple[int, ...] | None = None  # known without reading the tensor (None: read from the file's header)


@dataclass
class Checkpoint:
    """A checkpoint's tensors by model key (``state_dict`` name), and how to read a set of them."""

    path: Path
    format: str  # "safetensors" | "torch" | "dcp"
    where: dict[str, Stored]  # model key -> where it is stored
    read: Callable[[dict[str, torch.Tensor], dict[str, Stored]], tuple[list[str], int]] = field(repr=False)
    # read(destinations by model key, their Stored): fills each in place; returns the files opened, bytes read
    shapes: Callable[[dict[str, Stored]], dict[str, tuple[int, ...]]] = field(repr=False)
    # shapes(Stored by model key): each one's stored shape, from headers only


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The checkpoint at ``path``: a ``.safetensors`` file, a ``torch.save`` file, or a directory holding
    ``model.safetensors.index.json``, ``model.safetensors``, ``pytorch_model.bin[.index.json]`` or a
    torch.distributed.checkpoint (``.metadata``). Only indexes and headers are read here."""
    p = Path(os.path.abspath(path))
    if not p.exists():
        raise FileNotFoundError(f"load_weights: no checkpoint at {p}: the path does not exist")
    if p.is_dir():
        for name, opener in ((SAFETENSORS_INDEX, _index), (TORCH_INDEX, _index), (SAFETENSORS, _safetensors),
                             (TORCH_BIN, _torch_file), (".metadata", _dcp_dir)):
            if (p / name).exists():
                return opener(p / name if name != ".metadata" else p)
        raise FileNotFoundError(f"load_weights: {p} holds no checkpoint this reads: none of {SAFETENSORS_INDEX}, "
                                f"{SAFETENSORS}, {TORCH_INDEX}, {TORCH_BIN}, or a torch.distributed.checkpoint "
                                f"(.metadata); it holds {sorted(x.name for x in p.iterdir())[:8]}")
    return _safetensors(p) if p.suffix == ".safetensors" else _torch_file(p)


# ---- safetensors -----------------------------------------------------------------------------------
def _safetensors(file: Path) -> Checkpoint:
    with safe_open(str(file), framework="pt", device="cpu") as f:
        where = {k: Stored(str(file), k, tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    return _sharded(file, where, "safetensors")


def _index(index: Path) -> Checkpoint:
    """An index of shards (``weight_map``: key -> file): no shard is opened until its tensors are read."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"load_weights: {index} is not a checkpoint index (a JSON object with a 'weight_map' "
                         f"of tensor name -> shard file): {e}") from None
    where = {k: Stored(str(index.parent / f), k) for k, f in weight_map.items()}
    return _sharded(index, where, "safetensors" if index.name == SAFETENSORS_INDEX else "torch")


def _sharded(path: Path, where: dict[str, Stored], fmt: str) -> Checkpoint:
    def by_file(stored: dict[str, Stored]) -> dict[str, dict[str, str]]:
        files: dict[str, dict[str, str]] = {}
        for key, s in stored.items():
            files.setdefault(s.file, {})[key] = s.key
        return files

    def shapes(stored: dict[str, Stored]) -> dict[str, tuple[int, ...]]:
        out = {k: s.shape for k, s in stored.items() if s.shape is not None}
        for file, keys in by_file({k: s for k, s in stored.items() if s.shape is None}).items():
            with _open(file) as f:
                out.update({k: _shape(f, sk) for k, sk in keys.items()})
        return out

    def read(dest: dict[str, torch.Tensor], stored: dict[str, Stored]) -> tuple[list[str], int]:
        files = by_file({k: stored[k] for k in dest})
        nbytes = 0
        for file, keys in files.items():  # only the shards holding this stage's tensors, and only those tensors
            for group in _groups(keys, dest):
                with _open(file) as f:
                    for key, stored_key in group.items():
                        src = _get(f, stored_key)
                        nbytes += src.numel() * src.element_size()
                        with torch.no_grad():
                            dest[key].copy_(src)
                        del src
        return list(files), nbytes
    return Checkpoint(path, fmt, where, read, shapes)


def _groups(keys: dict[str, str], dest: dict[str, torch.Tensor]) -> list[dict[str, str]]:
    """``keys`` (model key -> stored key) in runs of about :data:`READ_BYTES` of destination bytes."""
    groups: list[dict[str, str]] = [{}]
    size = 0
    for key, stored_key in keys.items():
        if groups[-1] and size + dest[key].nbytes > READ_BYTES:
            groups.append({})
            size = 0
        groups[-1][key] = stored_key
        size += dest[key].nbytes
    return groups


def _open(file: str) -> Any:
    """A lazy reader of one shard: safetensors' ``safe_open``, or a ``torch.save`` file memory-mapped."""
    if file.endswith(".safetensors"):
        return safe_open(file, framework="pt", device="cpu")
    return _TorchShard(file)


def _shape(f: Any, key: str) -> tuple[int, ...]:
    return tuple(f.get_slice(key).get_shape()) if not isinstance(f, _TorchShard) else tuple(f.sd[key].shape)


def _get(f: Any, key: str) -> torch.Tensor:
    return f.get_tensor(key) if not isinstance(f, _TorchShard) else f.sd[key]


class _TorchShard:
    """A ``torch.save`` state dict as a context manager, memory-mapped: only the pages of tensors read are read."""

    def __init__(self, file: str):
        self.sd = load_torch_state(Path(file))

    def __enter__(self) -> "_TorchShard":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.sd = {}


# ---- torch.save ----------------------------------------------------------------------------------------
def load_torch_state(file: Path) -> Mapping[str, torch.Tensor]:
    """``torch.load(file, mmap=True, weights_only=True)``, checked to be a state dict (name -> tensor)."""
    try:
        sd = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:
        raise ValueError(f"load_weights: {file} is neither a .safetensors file nor a torch.save file torch.load "
                         f"can memory-map (weights_only=True): {type(e).__name__}: {str(e).splitlines()[0]}") from e
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        what = f"a dict with keys {list(sd)[:6]}" if isinstance(sd, Mapping) else type(sd).__name__
        raise ValueError(f"load_weights: {file} holds {what}, not a state dict of tensors: save "
                         f"model.state_dict() (or the entry of it that is one)")
    return sd


def _torch_file(file: Path) -> Checkpoint:
    sd = load_torch_state(file)
    where = {k: Stored(str(file), k, tuple(t.shape)) for k, t in sd.items()}
    return _sharded(file, where, "torch")


# ---- torch.distributed.checkpoint -----------------------------------------------------------------------------
def _dcp_dir(path: Path) -> Checkpoint:
    """A DCP directory: dapple's (tensors under their checkpoint keys, every state_dict name listed in its
    description) or any other whose keys are the model's ``state_dict`` names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(path).read_metadata()
    stored = {k: m for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    names = {k: [k] for k in stored}
    if META in md.state_dict_metadata:  # a dapple checkpoint: a tensor's key, and all its state_dict names
        box: dict[str, Any] = {META: None}
        dcp_read(path, box)
        names = {k: info["names"] for k, info in box[META]["tensors"].items() if k in stored}
    where = {n: Stored(str(path), k, tuple(stored[k].size)) for k, ns in names.items() for n in ns}

    def read(dest: dict[str, torch.Tensor], stored_at: dict[str, Stored]) -> tuple[list[str], int]:
        sd: dict[str, Any] = {}
        copies = []
        for key, t in dest.items():  # DCP copies into the destinations themselves (any device and dtype)
            k = stored_at[key].key
            if k in sd:  # one stored tensor for two of the model's (a tied checkpoint, an untied model)
                copies.append((t, sd[k]))
            else:
                sd[k] = t.detach()
        dcp_read(path, sd)
        with torch.no_grad():
            for t, src in copies:
                t.copy_(src)
        nbytes = sum(stored[k].size.numel() * _itemsize(stored[k].properties.dtype) for k in sd)
        return [str(path)], nbytes
    return Checkpoint(path, "dcp", where, read, lambda s: {k: tuple(stored[x.key].size) for k, x in s.items()})


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dcp_read(path: Path, sd: dict[str, Any]) -> None:
    """DCP load of ``sd``'s keys by this process alone (no collectives, whether or not a process group exists)."""
    import torch.distributed.checkpoint as dcp

    planner = dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        if "no_dist" in inspect.signature(dcp.load).parameters:
            dcp.load(sd, storage_reader=dcp.FileSystemReader(path), planner=planner, no_dist=True)
        else:  # torch < 2.5: only the loader behind dcp.load takes no_dist
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
            _load_state_dict(sd, dcp.FileSystemReader(path), planner=planner, no_dist=True)
