"""Which rows and which tensors of each step's batch a rank consumes, and the compact layout of its own rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union

import torch

from ..core.plan import Plan
from ..core.split_concat import slice_bounds


@dataclass(frozen=True)
class RankData:
    """What one rank of a plan reads from each step's batch (``pipe.data``; :func:`rank_data` without a model).

    A replica of a stage with R replicas computes rows ``slice_bounds(micro_batch_size, R)[replica]`` of every
    micro-batch; it reads the model inputs its stage's graph reads (``reads``) and, on the last stage, the targets.
    Its *compact* batch is those rows only, micro-batch after micro-batch: ``rows()`` lists their indices in the
    global batch, in that order.

    Attributes:
        rank, stage, replica: the rank and its place in the plan (a rank of several chunks: its first stage).
        input_names: the model's inputs, in ``forward``'s order.
        reads: per model input, whether this rank's stage reads it (usually stage 0 only; a later stage may read
            one too, e.g. a head that takes a second input).
        targets: whether this rank computes the loss (the last stage), and so reads the targets.
        micro_batch_size, global_batch_size: the plan's.
        slice: ``(start, end)``, this replica's rows of every micro-batch.
        stages: every stage the rank holds (its device group's chunks), in pipeline order.
    """

    rank: int
    stage: int
    replica: int
    input_names: tuple[str, ...]
    reads: tuple[bool, ...]
    targets: bool
    micro_batch_size: int
    global_batch_size: int
    slice: tuple[int, int]
    stages: tuple[int, ...] = ()

    @property
    def loads(self) -> bool:
        """Whether this rank reads anything from the batch (an input or the targets)."""
        return any(self.reads) or self.targets

    def micro_batches(self, batch_size: int | None = None) -> int:
        """The number of micro-batches in a batch of ``batch_size`` rows (default: the global batch)."""
        rows = self.global_batch_size if batch_size is None else batch_size
        b = self.micro_batch_size
        if isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0 or rows % b:
            raise ValueError(f"batch_size: expected a positive multiple of plan.micro_batch_size ({b}), got {rows!r}")
        return rows // b

    def rows(self, batch_size: int | None = None) -> list[int]:
        """The global-batch row indices this rank reads, in its compact order (micro-batch 0's slice, then
        micro-batch 1's, ...); ``[]`` on a rank that reads nothing.

        Args:
            batch_size: the batch's rows (default: the plan's global batch; an evaluation batch may be any
                multiple of the micro-batch size).
        """
        if not self.loads:
            return []
        lo, hi = self.slice
        b = self.micro_batch_size
        return [j * b + r for j in range(self.micro_batches(batch_size)) for r in range(lo, hi)]

    def row_count(self, batch_size: int | None = None) -> int:
        """``len(rows(batch_size))``: the rows of this rank's compact batch."""
        return self.micro_batches(batch_size) * (self.slice[1] - self.slice[0]) if self.loads else 0


def rank_data(plan: Plan, rank: int, input_stages: Sequence[Sequence[int]] = ((0,),),
              input_names: Sequence[str] | None = None) -> RankData:
    """What ``rank`` reads under ``plan``, without building the pipeline (``pipe.data`` is the same, with the
    stages that read each input taken from the traced model).

    Args:
        plan: the plan.
        rank: a rank of the plan (0 .. plan.num_devices - 1).
        input_stages: per model input, the stages whose layers read it (default: one input, read by stage 0); a rank
            of several chunks reads an input one of them reads, and the targets where it holds the last stage.
        input_names: the inputs' names (default: ``input0``, ``input1``, ...).
    """
    plan.validate()
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.num_devices:
        raise ValueError(f"rank: expected a rank of the plan, 0 to {plan.num_devices - 1}, got {rank!r}")
    readers = [tuple(s) for s in input_stages]
    for i, s in enumerate(readers):
        bad = [v for v in s if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < plan.num_stages]
        if bad:
            raise ValueError(f"input_stages[{i}]: expected stage indices 0 to {plan.num_stages - 1}, got {bad}")
    names = tuple(input_names) if input_names is not None else tuple(f"input{i}" for i in range(len(readers)))
    if len(names) != len(readers):
        raise ValueError(f"input_names: {len(names)} names for {len(readers)} inputs (input_stages)")
    mine = plan.stages_of_device(rank)
    replica = plan.stages[mine[0]].devices.index(rank)
    b = plan.micro_batch_size
    return RankData(rank, mine[0], replica, names, tuple(any(s in r for s in mine) for r in readers),
                    plan.num_stages - 1 in mine, b, plan.global_batch_size,
                    slice_bounds(b, plan.stages[mine[0]].replicas)[replica], tuple(mine))


class CompactRows:
    """A tensor that holds only a replica's rows (the compact layout), read by global batch rows: ``view[lo:hi]``
    gives rows ``lo:hi`` of the global batch, which must lie in the replica's slice of one micro-batch."""

    __slots__ = ("tensor", "micro_batch_size", "start", "count")

    def __init__(self, tensor: torch.Tensor, micro_batch_size: int, slice_: tuple[int, int]):
        self.tensor, self.micro_batch_size = tensor, micro_batch_size
        self.start, self.count = slice_[0], slice_[1] - slice_[0]

    def __getitem__(self, rows: slice) -> torch.Tensor:
        j, offset = divmod(rows.start, self.micro_batch_size)
        offset -= self.start
        if offset < 0 or offset + rows.stop - rows.start > self.count:
            raise IndexError(f"rows {rows.start}:{rows.stop} of the global batch are not in this replica's slice "
                             f"[{self.start}, {self.start + self.count}) of micro-batch {j}")
        first = j * self.count + offset
        return self.tensor[first:first + rows.stop - rows.start]


RowSource = Union[torch.Tensor, CompactRows]  # what a stage slices its rows from: global batch rows either way


@dataclass(frozen=True)
class StepBatch:
    """A step's batch as the runner reads it: per model input given, where its rows come from (None: not held
    here, only on ranks that read it), the targets (``()`` where not held), the inputs' shapes agreed across ranks
    (every rank infers the boundary shapes from them) and the batch's global rows."""

    inputs: tuple[RowSource | None, ...]
    targets: tuple[RowSource, ...]
    key: Any  # shapes.InputKey: per model input given, (shape after the batch dimension, dtype)
    rows: int
