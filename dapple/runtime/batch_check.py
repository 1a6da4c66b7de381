"""The ranks agree on each step's batch before it runs: its size, shapes, and the values of rows two ranks hold."""

# one small AllReduce per step; a gather only when something differs or a shape is new

from __future__ import annotations

import zlib
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..core.dist import bounded
from ..core.plan import Plan
from ..core.split_concat import slice_bounds
from ..profiler.layers import Arity
from .data import CompactRows, RankData, RowSource, StepBatch
from .rank_batch import Held, RankBatch
from .small_reduce import reduce_small

ABSENT = float("-inf")  # a value this rank does not hold: it takes no part in the agreement (MAX of v and -v)
DEFAULTED = -1.0  # an input this rank reads and leaves to its default (fingerprints are >= 0)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_LOW = 0xFFFFFFFF
CHUNK = 1 << 18  # elements a checksum reads at once: its int64 temporaries stay at 2 MiB whatever the batch


def row_atoms(plan: Plan) -> list[tuple[int, int]]:
    """The row ranges of a micro-batch that no stage's slice boundary cuts: each replica's rows are whole atoms,
    so two ranks that both hold an atom of a tensor can compare it."""
    b = plan.micro_batch_size
    cuts = sorted({e for s in plan.stages for bounds in slice_bounds(b, s.replicas) for e in bounds})
    return list(zip(cuts[:-1], cuts[1:]))


def row_bits(t: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """Per row (dim 0), the sum of its elements' bit patterns as int64 (wrapping): exact, so the same in any
    layout, order or device, and different almost surely where a row's values differ. Rows are summed in blocks of
    about ``chunk`` elements, so the temporaries stay bounded however large the batch."""
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.view(_BITS[x.element_size()])
    x = x.flatten(1) if x.dim() > 1 else x.unsqueeze(1)  # (rows, elements per row); a view where x is contiguous
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)  # (rows,)
    step = max(1, chunk // max(1, x.shape[1]))
    for lo in range(0, x.shape[0], step):
        torch.sum(x[lo:lo + step], 1, dtype=torch.int64, out=out[lo:lo + step])
    return out


def fingerprint(entries: Any) -> float:
    """A shape-and-dtype description as a float64 (crc32 of its repr: < 2**32, exact)."""
    return float(zlib.crc32(repr(entries).encode()))


def _describe(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    return tuple(t.shape[1:]), t.dtype


class BatchCheck:
    """Runs the agreement for one pipeline: what every rank holds of each step's batch is consistent, and the
    inputs' shapes (which every rank needs, to infer the boundary shapes) are known everywhere afterwards.

    Agreed, among the ranks that hold each: the batch's global rows; per model input, its shape after the batch
    dimension and dtype (or that it is left to its default); the targets' shapes and dtypes; and with ``values``,
    per input, for the targets and for the dataset rows (``ids``), per atom of rows (:func:`row_atoms`), two exact
    sums of the rows' bit patterns over all micro-batches (plain and weighted by global row index).
    """

    def __init__(self, data: RankData, plan: Plan, arity: Arity, device: torch.device, timeout: float):
        self.data, self.arity, self.device, self.timeout = data, arity, device, timeout
        self.atoms = row_atoms(plan)
        b = plan.micro_batch_size
        self._atom_of = torch.tensor([a for a, (lo, hi) in enumerate(self.atoms) for _ in range(lo, hi)])  # (b,)
        self._shapes: dict[float, tuple[tuple[int, ...], torch.dtype]] = {}  # fingerprint -> (shape, dtype)
        self._seen: set[tuple[float, ...]] = set()  # agreed inputs' fingerprints whose shapes every rank has
        self._b = b

    @property
    def _n(self) -> int:
        return len(self.data.input_names)

    def check(self, batch: RankBatch | None, error: BaseException | None, who: str, moment: str, values: bool
              ) -> StepBatch:
        """Agree with every other rank (collective); raise on every rank if any rank's batch is wrong or the
        batches disagree: ``error`` (this rank's own, from :func:`rank_batch`) is raised as it is, the others
        raise ValueError naming the rank and its error. Errors begin "``who``, ``moment``". Returns the batch for
        the runner."""
        where = f"{who}, {moment}"
        mine = self._vector(batch, values)
        both = torch.cat([mine, torch.where(mine == ABSENT, mine, -mine),
                          torch.tensor([float(error is not None)], dtype=torch.float64, device=self.device)])
        reduce_small(both, "max", self.timeout, who, f"{moment}: checking that the ranks' batches agree",
                     range(dist.get_world_size()))
        red = both.tolist()  # one copy to the host
        k = mine.numel()
        most, least = red[:k], [-v for v in red[k:2 * k]]
        if red[-1] > 0:
            self._refuse(batch, error, where)
        differ = [i for i in range(k) if most[i] != ABSENT and most[i] != least[i]]
        if differ:
            self._disagree(batch, where, mine, self._cause(differ))
        fps = self._key_fingerprints(most, where)
        if fps not in self._seen:
            self._learn_shapes(batch, where)
            self._seen.add(fps)
        key = tuple(self._shapes[fp] for fp in fps)
        return StepBatch(self._sources(batch, len(key)), self._targets(batch), key, int(most[0]))

    # ---- this rank's part ----------------------------------------------------------------------
    def _vector(self, batch: RankBatch | None, values: bool) -> torch.Tensor:
        """[rows, per input its fingerprint, the targets' fingerprint, per (input, targets or ids; atom) 4 sums]."""
        n, a = self._n, len(self.atoms)
        v = torch.full((2 + n + (n + 2) * a * 4,), ABSENT, dtype=torch.float64)
        if batch is None:
            return v.to(self.device)
        if batch.rows is not None:
            v[0] = batch.rows
        for i, h in enumerate(batch.inputs or ()):
            if h is not None and i < n:
                v[1 + i] = fingerprint(_describe(h.tensor))
        for i in batch.defaulted:
            v[1 + i] = DEFAULTED
        if batch.targets is not None:
            v[1 + n] = fingerprint([_describe(h.tensor) for h in batch.targets])
        v = v.to(self.device)
        if values and batch.rows is not None:  # also what it holds unread: that proves its batch is the others'
            sums = v[2 + n:].view(n + 2, a, 4)
            for i, h in enumerate(batch.inputs or ()):
                if h is not None and i < n:
                    self._fill(sums[i], [h], batch.rows)
            if batch.targets is not None:
                self._fill(sums[n], batch.targets, batch.rows)
            if batch.ids is not None:
                self._fill(sums[n + 1], [batch.ids], batch.rows)
        return v

    def _fill(self, out: torch.Tensor, held: Sequence[Held], rows: int) -> None:
        """``out`` (atoms, 4): per atom that every tensor of ``held`` holds, the hi and lo 32 bits of the plain and
        weighted sums of its rows' bits (tensor k weighted by k + 1) over all micro-batches; ABSENT elsewhere."""
        device = held[0].tensor.device
        plain = torch.zeros(len(self.atoms), dtype=torch.int64, device=device)
        weighted = torch.zeros_like(plain)
        mine = torch.ones(len(self.atoms), dtype=torch.bool, device=device)
        for k, h in enumerate(held):
            pos = torch.tensor(self.data.rows(rows)) if h.compact else torch.arange(rows)  # its global rows
            pos = pos.to(device)
            atom = self._atom_of.to(device)[pos % self._b]
            bits = row_bits(h.tensor).to(device) * (k + 1)
            plain.index_add_(0, atom, bits)
            weighted.index_add_(0, atom, bits * (pos + 1))
            mine &= torch.zeros_like(mine).index_fill_(0, atom, True)
        sums = torch.stack([plain >> 32, plain & _LOW, weighted >> 32, weighted & _LOW], 1).double()
        out[mine.to(out.device)] = sums[mine].to(out.device)

    def _sources(self, batch: RankBatch | None, length: int) -> tuple[RowSource | None, ...]:
        """Per input of the key, where this rank's stage reads its rows (None: an input it does not read)."""
        held = (batch.inputs or ()) if batch is not None else ()
        sources: list[RowSource | None] = []
        for i in range(length):
            h = held[i] if i < len(held) else None
            sources.append(self._source(h) if self.data.reads[i] and h is not None else None)
        return tuple(sources)

    def _targets(self, batch: RankBatch | None) -> tuple[RowSource, ...]:
        if batch is None or batch.targets is None or not self.data.targets:
            return ()
        return tuple(self._source(h) for h in batch.targets)

    def _source(self, h: Held) -> RowSource:
        return CompactRows(h.tensor, self._b, self.data.slice) if h.compact else h.tensor

    # ---- what every rank learns ------------------------------------------------------------------
    def _key_fingerprints(self, most: list[float], where: str) -> tuple[float, ...]:
        """The agreed inputs' fingerprints, up to the last input given; ValueError (every rank) for a gap."""
        n, names = self._n, self.data.input_names
        if most[0] == ABSENT:
            raise ValueError(f"{where}: no rank was given a tensor of the batch, so none can tell its size: pass "
                             f"batch_size= to eval_step")
        given = [i for i in range(n) if most[1 + i] >= 0]
        length = given[-1] + 1 if given else 0
        gaps = [i for i in range(length) if most[1 + i] < 0]
        if gaps:
            raise ValueError(f"{where}: input {gaps[0]} ({names[gaps[0]]!r}) was given to no rank (or left to its "
                             f"default) while input {length - 1} ({names[length - 1]!r}) was given: pass it on the "
                             f"ranks that read it, or on any rank if none does")
        self.arity.check(length, "inputs (given across the ranks)")  # an input no stage reads but the call needs
        return tuple(most[1:1 + length])

    def _gather(self, batch: RankBatch | None, where: str, what: str, extra: Any = None) -> list[dict[str, Any]]:
        report = {"stage": self.data.stage, "rows": batch.rows if batch else None, "extra": extra,
                  "inputs": None if batch is None or batch.inputs is None else
                  [None if h is None else _describe(h.tensor) for h in batch.inputs],
                  "targets": None if batch is None or batch.targets is None else
                  [_describe(h.tensor) for h in batch.targets]}
        everyone: list[Any] = [None] * dist.get_world_size()
        bounded(self.timeout, f"{where}: gathering every rank's {what}", dist.all_gather_object, everyone, report)
        return everyone

    def _learn_shapes(self, batch: RankBatch | None, where: str) -> None:
        """Inputs' shapes first seen: every rank gathers them from the ranks that hold each."""
        for r, rep in enumerate(self._gather(batch, where, "inputs' shapes")):
            for entry in rep["inputs"] or ():
                if entry is not None:
                    fp = fingerprint(entry)
                    if self._shapes.setdefault(fp, entry) != entry:
                        raise ValueError(f"{where}: inputs of shapes {self._shapes[fp]} and {entry} (rank {r}) "
                                         f"have the same fingerprint; pass inputs of one shape on every rank")

    def _refuse(self, batch: RankBatch | None, error: BaseException | None, where: str) -> None:
        """Some rank's own batch was wrong: it raises its error, the others a ValueError naming it."""
        reports = self._gather(batch, where, "errors", None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        bad = "; ".join(f"rank {r} (stage {rep['stage']}): {rep['extra']}" for r, rep in enumerate(reports)
                        if rep["extra"] is not None)
        raise ValueError(f"{where}: another rank's batch was refused, so no rank runs this step: {bad}")

    def _cause(self, differ: list[int]) -> int:
        """The disagreement to report: the size or a shape first, then the dataset rows (different rows loaded
        explain different values), then the first value."""
        values = 2 + self._n
        ids = values + (self._n + 1) * len(self.atoms) * 4
        return differ[0] if differ[0] < values else next((i for i in differ if i >= ids), differ[0])

    def _disagree(self, batch: RankBatch | None, where: str, mine: torch.Tensor, first: int) -> None:
        """ValueError on every rank naming what differs: the batch's size, shapes, or values."""
        n = self._n
        reports = self._gather(batch, where, "batches", mine.tolist())
        if first == 0:
            shown = "; ".join(f"rank {r}: {rep['rows']}" for r, rep in enumerate(reports) if rep["rows"] is not None)
            raise ValueError(f"{where}: the ranks were given batches of different sizes (global rows: {shown}); an "
                             f"evaluation batch of this rank's own rows needs batch_size= (its global rows) on "
                             f"every rank")
        if first <= n:
            shown = "; ".join(f"rank {r}: {_shapes(rep['inputs'])}" for r, rep in enumerate(reports))
            raise ValueError(f"{where}: the ranks were given inputs of different shapes or dtypes (the ranks that "
                             f"hold an input must agree on it: every rank reads the shapes of the inputs it holds); "
                             f"per input, (shape after the batch dimension, dtype): {shown}")
        if first == n + 1:
            shown = "; ".join(f"rank {r}: {_shapes(rep['targets'])}" for r, rep in enumerate(reports))
            raise ValueError(f"{where}: the ranks were given targets of different shapes or dtypes; per target, "
                             f"(shape after the batch dimension, dtype): {shown}")
        self._values_differ(reports, where, first - n - 2)

    def _values_differ(self, reports: list[dict[str, Any]], where: str, index: int) -> None:
        n, names = self._n, self.data.input_names
        slot, atom = divmod(index // 4, len(self.atoms))
        at = 2 + n + (slot * len(self.atoms) + atom) * 4
        groups: dict[tuple, list[int]] = {}
        for r, rep in enumerate(reports):
            sums = tuple(rep["extra"][at:at + 4])
            if sums[0] != ABSENT:
                groups.setdefault(sums, []).append(r)
        lo, hi = self.atoms[atom]
        if slot == n + 1:
            raise ValueError(f"{where}: the ranks loaded different dataset rows (ids) for the same rows of the batch: "
                             f"rows [{lo}, {hi}) of every micro-batch: ranks with equal ids: "
                             f"{sorted(groups.values())}. Every rank's loader must draw the same order: the same "
                             f"dataset length, seed, epoch (set_epoch on every rank) and step")
        which = "inputs" if slot < n else "targets"
        what = f"input {slot} ({names[slot]!r})" if slot < n else "the targets"
        raise ValueError(f"{where}: the ranks were given different {which} of the same shapes: ranks that hold the "
                         f"same rows must hold the same values (each rank passes the global batch, or the rows "
                         f"pipe.rows() lists, not its own shard, as with DDP); {what}, rows [{lo}, {hi}) of every "
                         f"micro-batch: ranks with equal values: {sorted(groups.values())}. Pass check_inputs=False "
                         f"to dapple.pipeline to skip this check")


def _shapes(entries: list | None) -> Any:
    """Per tensor given, (shape after the batch dimension, dtype) as lists and strings; None for none."""
    if entries is None:
        return None
    return [None if e is None else (list(e[0]), str(e[1])) for e in entries]
