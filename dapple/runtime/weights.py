"""``dapple.load_weights``: each rank reads only its stage's tensors from a checkpoint, by ``state_dict`` name."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from .engine import Pipeline
from .state import StateNames, own_tensors
from .weight_files import Stored, open_checkpoint


@dataclass(frozen=True)
class LoadedWeights:
    """What :func:`load_weights` read on this rank."""

    path: str
    format: str  # "safetensors" | "torch" | "dcp"
    files: list[str]  # the files (a DCP directory: the directory) this rank opened to read tensors
    tensors: int  # distinct tensors read (a tied tensor once)
    bytes: int  # bytes of the tensors read, as stored
    seconds: float
    unexpected_keys: list[str]  # the checkpoint's keys that no stage of the model holds


def load_weights(pipe: Pipeline, path: str | os.PathLike) -> LoadedWeights:
    """Copy this rank's stage's parameters and persistent buffers from the checkpoint at ``path``, reading only
    those tensors (call on every rank, or on any; no collective).

    Keys are the original model's ``state_dict`` names. A tensor the model has under several names (a tied
    weight) loads from whichever the checkpoint stores (transformers saves ``lm_head.weight`` tied to
    ``model.embed_tokens.weight`` under the latter only). Values are cast to the model's dtypes.

    Args:
        pipe: this rank's pipeline (typically of a meta-device model: see :func:`dapple.pipeline`'s ``init_fn``).
        path: a transformers checkpoint (a ``.safetensors`` file, or a directory with ``model.safetensors`` or
            a sharded ``model.safetensors.index.json``; ``pytorch_model.bin[.index.json]`` too), a ``torch.save``
            state dict (memory-mapped: only the pages of this stage's tensors are read), or a directory written by
            :func:`dapple.save_checkpoint` or ``torch.distributed.checkpoint`` (keyed by ``state_dict`` names). A
            sharded checkpoint's index says which shards hold this stage's tensors; only those are opened.

    Returns:
        :class:`LoadedWeights`: the files opened, tensors and bytes read, time taken, and the checkpoint's keys
        no stage holds (reported, not an error: transformers checkpoints carry some).

    Raises:
        FileNotFoundError: nothing at ``path``, or a directory holding no checkpoint.
        ValueError: a tensor of this stage that the checkpoint lacks, or stores with another shape (every one
            named, before anything is copied), or a file that is no checkpoint.
    """
    if not isinstance(pipe, Pipeline):
        raise TypeError(f"pipe: expected a dapple.Pipeline (from dapple.pipeline(...)), got {type(pipe).__name__}")
    start = time.perf_counter()
    ckpt = open_checkpoint(path)
    where = f"rank {pipe.ctx.rank} (stage {pipe.stage}): load_weights({str(ckpt.path)!r})"
    names = StateNames(pipe.state_names, pipe.state_order)
    dest, stored = _destinations(own_tensors(pipe.module, names), ckpt.where, where)
    _check_shapes(dest, ckpt.shapes(stored), where)
    files, nbytes = ckpt.read(dest, stored)
    held = set(pipe.state_order)
    return LoadedWeights(str(ckpt.path), ckpt.format, files, len(dest), nbytes, time.perf_counter() - start,
                         [k for k in ckpt.where if k not in held])


def _destinations(own: dict[str, torch.Tensor], where: dict[str, Stored], what: str
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Stored]]:
    """One destination per distinct tensor of the stage, under the first of its names the checkpoint stores;
    ValueError naming every tensor it stores under none."""
    dest: dict[str, torch.Tensor] = {}
    stored: dict[str, Stored] = {}
    names: dict[int, list[str]] = {}
    for key, t in own.items():
        names.setdefault(id(t), []).append(key)
    missing = []
    for keys in names.values():
        hit = next((k for k in keys if k in where), None)
        if hit is None:
            missing.append(" = ".join(repr(k) for k in keys))
            continue
        dest[hit], stored[hit] = own[hit], where[hit]
    if missing:
        sample = ", ".join(repr(k) for k in list(where)[:4])
        raise ValueError(f"{what}: the checkpoint lacks {len(missing)} tensor(s) of this stage: "
                         f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}; it holds {len(where)} "
                         f"such as {sample} (another model, or names with another prefix?)")
    return dest, stored


def _check_shapes(dest: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], what: str) -> None:
    bad = [f"{k!r}: checkpoint {tuple(shapes[k])}, model {tuple(t.shape)}" for k, t in dest.items()
           if tuple(shapes[k]) != tuple(t.shape)]
    if bad:
        raise ValueError(f"{what}: shapes differ: {'; '.join(bad[:6])}{' ...' if len(bad) > 6 else ''} "
                         f"(a checkpoint of a model of another size?)")
