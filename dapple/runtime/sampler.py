"""Per-rank loading from a Dataset: each step, a rank loads only the rows it reads, and only the tensors it reads."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sized, cast

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from .data import RankData

_WORKER_OPTIONS = ("num_workers", "prefetch_factor", "persistent_workers", "worker_init_fn", "multiprocessing_context")


def _rank_data(source: Any) -> RankData:
    """A RankData, from itself or from a Pipeline's ``data``."""
    data = getattr(source, "data", source)
    if not isinstance(data, RankData):
        raise TypeError(f"expected a dapple.Pipeline or a dapple.runtime.RankData (dapple.runtime.rank_data(plan, "
                        f"rank)), got {type(source).__name__}")
    return data


class DistributedPipelineSampler(Sampler[list[int]]):
    """A batch sampler: for each step, the dataset indices this rank loads, in the order of its compact batch.

    Every rank draws the same permutation of the dataset (from ``seed`` and the epoch); step ``s`` takes its
    ``batch_size`` entries from ``s * batch_size`` on (the global batch), and this rank keeps those at its
    :meth:`RankData.rows`: its rows of each micro-batch, for the tensors it reads. A rank that reads nothing gets
    ``[]`` each step (the same number of steps). A row is thus loaded by one replica of each stage that reads
    part of it. The rows left over after the last whole batch of an epoch are not used in that epoch.

    Args:
        dataset_len: the number of rows in the dataset (``len(dataset)``).
        source: a :class:`dapple.Pipeline` (``pipe.data``) or a :class:`RankData`.
        batch_size: rows per step (default: the plan's global batch; an evaluation may take any multiple of the
            micro-batch size, then passed to ``eval_step`` as its ``batch_size``).
        shuffle: a new permutation each epoch (:meth:`set_epoch`); False: the dataset's order.
        seed: the permutation's seed, the same on every rank.
    """

    def __init__(self, dataset_len: int, source: Any, batch_size: int | None = None, shuffle: bool = True,
                 seed: int = 0):
        self.data = _rank_data(source)
        self.batch_size = self.data.global_batch_size if batch_size is None else batch_size
        self.data.micro_batches(self.batch_size)  # ValueError unless a multiple of the micro-batch size
        if isinstance(dataset_len, bool) or not isinstance(dataset_len, int) or dataset_len < self.batch_size:
            raise ValueError(f"dataset_len: expected an int of at least batch_size ({self.batch_size}) rows, got "
                             f"{dataset_len!r}")
        if not isinstance(shuffle, bool) or isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"shuffle: expected True or False and seed an int, got {shuffle!r} and {seed!r}")
        self.dataset_len, self.shuffle, self.seed, self.epoch = dataset_len, shuffle, seed, 0
        self._drawn: tuple[int, torch.Tensor] | None = None  # (epoch, its permutation): drawn once per epoch
        self.rows = self.data.rows(self.batch_size)
        self._rows = torch.tensor(self.rows, dtype=torch.long)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s permutation (call on every rank before iterating, as for DistributedSampler)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.dataset_len // self.batch_size

    def global_indices(self, step: int) -> list[int]:
        """The dataset indices of step ``step``'s whole batch in this epoch (the same on every rank): row ``r`` of
        the global batch (as in ``pipe.rows()`` and ``eval_step``'s outputs) is dataset row ``[r]``."""
        if not 0 <= step < len(self):
            raise IndexError(f"step {step}: an epoch has {len(self)} steps")
        first = step * self.batch_size
        return self._order()[first:first + self.batch_size].tolist()

    def indices(self, step: int) -> list[int]:
        """The dataset indices this rank loads at step ``step`` of this epoch."""
        self.global_indices(step)  # IndexError for a step out of range
        return self._batch(self._order(), step)

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        for step in range(len(self)):
            yield self._batch(order, step)

    def _batch(self, order: torch.Tensor, step: int) -> list[int]:
        first = step * self.batch_size
        return order[first:first + self.batch_size][self._rows].tolist()

    def _order(self) -> torch.Tensor:
        if self._drawn is None or self._drawn[0] != self.epoch:
            order = (torch.randperm(self.dataset_len, generator=torch.Generator().manual_seed(self.seed + self.epoch))
                     if self.shuffle else torch.arange(self.dataset_len))
            self._drawn = (self.epoch, order)
        return self._drawn[1]


def _pair(item: Any) -> tuple[Any, Any]:
    """A dataset item as (inputs, targets): the default ``split``."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise TypeError(f"a dataset item must be a pair (inputs, targets), got {type(item).__name__}"
                        f"{f' of {len(item)}' if isinstance(item, (tuple, list)) else ''}; pass split= to "
                        f"pipeline_loader to say how to split it")
    return item[0], item[1]


class LoadedBatch(NamedTuple):
    """One step's batch as this rank loaded it: ``pipe.train_step(*batch)``, or ``pipe.eval_step(*batch)``, where
    ``batch_size`` tells that the tensors are this rank's rows of a batch of that many rows, and ``ids`` lets the
    ranks check that they loaded the same dataset rows for the same batch rows."""

    inputs: Any  # the inputs this rank reads, its rows (None in place of the others; None if it reads none)
    targets: Any  # on the last stage, its rows of the targets; elsewhere None
    batch_size: int  # the step's global rows
    ids: torch.Tensor | None = None  # the dataset row of each of its rows (int64); None: not known


class IndexedDataset(Dataset):
    """``dataset``'s items with their index, ``(i, dataset[i])``: what :class:`RankCollate` takes with
    ``indexed=True``, so that a batch carries its dataset rows."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(cast(Sized, self.dataset))  # map-style: torch's Dataset type declares no length

    def __getitem__(self, i: int) -> tuple[int, Any]:
        return i, self.dataset[i]


class RankCollate:
    """Collates a step's items into this rank's :class:`LoadedBatch`: only the inputs it reads (None in place of
    the others, None for all if it reads none) and the targets on the last stage (else None).

    Args:
        data: what this rank reads.
        batch_size: the global rows of each step (default: the plan's global batch).
        split: item -> (inputs, targets) (default: the item is that pair).
        collate: stacks one input's (or the targets') values over the step's items.
        indexed: the items are ``(dataset index, item)`` (:class:`IndexedDataset`): the batch's ``ids``.
    """

    def __init__(self, data: RankData, batch_size: int | None = None,
                 split: Callable[[Any], tuple[Any, Any]] | None = None,
                 collate: Callable[[list], Any] = default_collate, indexed: bool = False):
        self.data, self.split, self.collate, self.indexed = data, split or _pair, collate, indexed
        self.batch_size = data.global_batch_size if batch_size is None else batch_size

    def __call__(self, items: list) -> LoadedBatch:
        ids = torch.tensor([i for i, _ in items], dtype=torch.long) if self.indexed else None
        if self.indexed:
            items = [item for _, item in items]
        if not items:
            return LoadedBatch(None, None, self.batch_size, ids)
        pairs = [self.split(item) for item in items]
        if isinstance(pairs[0][0], Mapping):  # inputs by name: those this rank reads ({} where none)
            reads = {name for name, r in zip(self.data.input_names, self.data.reads) if r}
            named = {k: self.collate([x[k] for x, _ in pairs]) for k in pairs[0][0] if k in reads}
            ys = self.collate([y for _, y in pairs]) if self.data.targets else None
            return LoadedBatch(named or None, ys, self.batch_size, ids)
        single = not isinstance(pairs[0][0], (tuple, list))
        inputs = [(x,) if single else tuple(x) for x, _ in pairs]
        xs = tuple(self.collate([x[i] for x in inputs]) if i < len(self.data.reads) and self.data.reads[i] else None
                   for i in range(len(inputs[0])))
        ys = self.collate([y for _, y in pairs]) if self.data.targets else None
        if all(x is None for x in xs):
            return LoadedBatch(None, ys, self.batch_size, ids)
        return LoadedBatch(xs[0] if single else xs, ys, self.batch_size, ids)


def pipeline_loader(dataset: Dataset, source: Any, batch_size: int | None = None, shuffle: bool = True,
                    seed: int = 0, split: Callable[[Any], tuple[Any, Any]] | None = None,
                    collate_fn: Callable[[list], Any] = default_collate, **loader_kwargs: Any) -> DataLoader:
    """A DataLoader that yields, each step, this rank's :class:`LoadedBatch` ``(inputs, targets, batch_size, ids)``
    for ``pipe.train_step(*batch)`` or ``pipe.eval_step(*batch)``: it reads from ``dataset`` only the rows this rank
    reads (:class:`DistributedPipelineSampler`), and keeps only the tensors it reads (:class:`RankCollate`); a rank
    that reads nothing reads no row and yields ``(None, None, batch_size, ids)`` with no ids, without worker
    processes. The loader's ``dataset`` is ``IndexedDataset(dataset)``.

    Args:
        dataset: a map-style ``torch.utils.data.Dataset`` whose items are ``(inputs, targets)`` (inputs a tensor, a
            tuple of tensors or a dict of them by ``forward``'s argument names; targets a tensor or tuple), or
            anything ``split`` turns into that pair.
        source: a :class:`dapple.Pipeline` or a :class:`RankData`.
        batch_size, shuffle, seed: as for :class:`DistributedPipelineSampler` (call ``loader.batch_sampler
            .set_epoch(epoch)`` each epoch when shuffling).
        split: item -> (inputs, targets).
        collate_fn: stacks one input's (or the targets') values over the step's items.
        loader_kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, ...).
    """
    data = _rank_data(source)
    size = len(cast(Sized, dataset))  # map-style: torch's Dataset type declares no length
    sampler = DistributedPipelineSampler(size, data, batch_size, shuffle, seed)
    if not data.loads:  # nothing to read: no worker processes either
        loader_kwargs = {k: v for k, v in loader_kwargs.items() if k not in _WORKER_OPTIONS}
    collate = RankCollate(data, sampler.batch_size, split, collate_fn, indexed=True)
    return DataLoader(IndexedDataset(dataset), batch_sampler=sampler, collate_fn=collate, **loader_kwargs)
