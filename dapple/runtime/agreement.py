"""Every rank builds the same pipeline: one small AllReduce compares a fingerprint of what each rank was given."""

# On a mismatch, two object gathers find which ranks differ and in what: the digests of each section, then the
# entries of the sections that differ (from one rank of each variant only).

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..core.dist import PipelineError, first_line
from ..core.plan import Plan
from ..core.version import VERSION
from .roll import called, waited

SHOWN_SECTIONS, SHOWN_ENTRIES = 3, 3  # what an error lists at most


@dataclass(frozen=True)
class Description:
    """What must be the same on every rank, as text: section -> entry -> value (e.g. "plan" -> "stages[1].layers"
    -> "[4, 6)"). Not the plan's ``meta`` or ``estimate``, which do not change what runs."""

    sections: dict[str, dict[str, str]]

    def digests(self) -> dict[str, int]:
        return {name: digest(list(entries.items())) for name, entries in self.sections.items()}


def digest(value: Any) -> int:
    """A 62-bit digest of ``value``'s repr (non-negative, and its negation fits an int64)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "big") >> 2


def _span(layers: Sequence[int]) -> str:
    return f"[{int(layers[0])}, {int(layers[1])})"


def _callable_name(fn: Any) -> str:
    kind = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(kind, '__module__', '?')}.{kind.__qualname__}"


def describe(plan: Plan, model: nn.Module, layer_names: Sequence[str], input_names: Sequence[str], *,
             precision: str | None, recompute: Sequence[Any], loss_fn: Callable, options: dict[str, Any]
             ) -> Description:
    """This rank's :class:`Description`: the plan (stages, micro-batching, schedule, layer names), the traced
    model (layers, inputs, every parameter's and buffer's name, shape and dtype), the features it runs with
    (``precision``, per-stage ``recompute``, ``loss_fn``'s name, ``options``) and the versions."""
    stages: dict[str, str] = {}
    for i, s in enumerate(plan.stages):
        stages[f"stages[{i}].layers"] = _span(s.layers)
        stages[f"stages[{i}].devices"] = str([int(d) for d in s.devices])
        stages[f"stages[{i}].warmup"] = str(None if s.warmup is None else int(s.warmup))
    names = plan.layer_names
    tensors = {k: f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
               for k, t in model.state_dict(keep_vars=True).items()}
    return Description({
        "software": {"dapple": VERSION, "torch": str(torch.__version__)},
        "plan": {"global_batch_size": str(int(plan.global_batch_size)),
                 "micro_batch_size": str(int(plan.micro_batch_size)), "schedule": str(plan.schedule),
                 "stages": str(plan.num_stages), **stages},
        "plan's layer list": {"layer_names": "none"} if names is None else
        {"layer_names": f"{len(names)} names", **{f"layer_names[{i}]": repr(str(n)) for i, n in enumerate(names)}},
        "options": {"mixed_precision": str(precision), "recompute": str(list(recompute)),
                    "loss_fn": _callable_name(loss_fn), **{k: repr(v) for k, v in options.items()}},
        "model": {"inputs": str(list(input_names)), "layers": f"{len(layer_names)} layers",
                  **{f"layers[{i}]": repr(str(n)) for i, n in enumerate(layer_names)},
                  "dtypes": str(sorted({v.split(" ")[-1] for v in tensors.values()}))},
        "model's tensor list": tensors,
    })


def agree(desc: Description, rank: int, world_size: int, device: torch.device, timeout: float) -> None:
    """Check that every rank was given what this rank was (collective, bounded by ``timeout``).

    Raises:
        ValueError: on every rank, naming the ranks that differ and in what (entries and both values).
        PipelineError: a rank did not come within ``timeout`` (the message names it and where it is), or one
            failed building its pipeline (:func:`failures_told`; the message names it and its error).
    """
    if world_size == 1:
        return
    who, everyone = f"rank {rank}", range(world_size)
    sections = desc.digests()
    total = digest(list(sections.items()))
    if _compared([total, -total, 0], rank, world_size, device, timeout):  # MAX: the largest, -smallest, failed
        return
    place = "dapple.pipeline: gathering what differs between the ranks' plans, models and options"
    digests: list[Any] = [None] * world_size
    called(timeout, who, place, everyone, dist.all_gather_object, digests, sections)
    differ = [s for s in desc.sections if len({d.get(s) for d in digests}) > 1][:SHOWN_SECTIONS]
    variants = {s: _variants([d.get(s) for d in digests]) for s in differ}
    mine = {s: desc.sections[s] for s in differ if any(ranks[0] == rank for ranks in variants[s])}
    details: list[Any] = [None] * world_size
    called(timeout, who, place, everyone, dist.all_gather_object, details, mine)
    raise ValueError(f"dapple.pipeline: the ranks were not all given the same plan, model and options: "
                     f"{_explain(differ, variants, details)} (build the pipeline on every rank from the same plan, "
                     f"model and arguments)")


@contextmanager
def failures_told(rank: int, world_size: int, device: torch.device, timeout: float) -> Iterator[None]:
    """Run the block that builds this rank's pipeline up to :func:`agree`; where it raises on this rank, the other
    ranks (waiting in :func:`agree`) are told which rank failed and why, then the error goes on. Without this they
    would wait out the timeout."""
    try:
        yield
    except Exception as e:
        if world_size > 1:
            try:
                _compared([0, 0, 1], rank, world_size, device, timeout, f"{type(e).__name__}: {first_line(e)}")
            except Exception:  # (the others are elsewhere: they time out naming this rank; its own error goes on)
                pass
        raise


def _compared(values: list[int], rank: int, world_size: int, device: torch.device, timeout: float,
              failure: str | None = None) -> bool:
    """The agreement's AllReduce (MAX) of ``values``: [digest, -digest, failed]; True where every digest is equal
    and no rank failed. A rank that failed (``failure``: its error) makes every other rank raise, naming it."""
    who, everyone = f"rank {rank}", range(world_size)
    vec = torch.tensor(values, dtype=torch.int64, device=device)
    waited(dist.all_reduce(vec, op=dist.ReduceOp.MAX, async_op=True), timeout, who,
           "dapple.pipeline: comparing every rank's plan, model and options", everyone)
    high, low, failed = vec.tolist()
    if not failed:
        return high == -low
    errors: list[Any] = [None] * world_size
    called(timeout, who, "dapple.pipeline: gathering why a rank failed to build its pipeline", everyone,
           dist.all_gather_object, errors, failure)
    if failure is None:
        ranks = [r for r, m in enumerate(errors) if m is not None]
        raise PipelineError(f"{who}: dapple.pipeline: rank {ranks[0]} failed building its pipeline"
                            f"{f' (and ranks {ranks[1:]})' if len(ranks) > 1 else ''}: {errors[ranks[0]]}")
    return False


def _variants(values: list[Any]) -> list[list[int]]:
    """The ranks holding each distinct value: the most common value first (a tie: the lowest rank's)."""
    out: dict[Any, list[int]] = {}
    for r, v in enumerate(values):
        out.setdefault(v, []).append(r)
    return sorted(out.values(), key=lambda ranks: (-len(ranks), ranks[0]))


def _explain(differ: list[str], variants: dict[str, list[list[int]]], details: list[Any]) -> str:
    """"rank 2's plan differs from rank 0's in stages[1].layers: [4, 7) vs [4, 6); ..." for each differing
    section, against the variant most ranks hold."""
    parts = []
    for s in differ:
        ref_ranks, *others = variants[s]
        ref = details[ref_ranks[0]][s]
        also = f" (as on ranks {ref_ranks})" if len(ref_ranks) > 1 else ""
        for ranks in others:
            got = details[ranks[0]][s]
            keys = list(dict.fromkeys([*got, *ref]))
            diff = [k for k in keys if got.get(k) != ref.get(k)]
            shown = ", ".join(f"{k}: {got.get(k, 'absent')} vs {ref.get(k, 'absent')}" for k in diff[:SHOWN_ENTRIES])
            more = f" and {len(diff) - SHOWN_ENTRIES} more" if len(diff) > SHOWN_ENTRIES else ""
            name = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
            parts.append(f"{name}'s {s} differs from rank {ref_ranks[0]}'s{also} in {shown}{more}")
    return "; ".join(parts)
