"""One rank's train_step/eval_step arguments, checked on that rank: which tensors it holds, and in which layout."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Any, Literal, Mapping, overload

import torch

from ..profiler.by_name import by_position, keyword_tensors
from ..profiler.layers import Arity
from .data import RankData

_INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass(frozen=True)
class Held:
    """A tensor a rank was given: the global batch (every row), or compact (only this rank's rows, in order)."""

    tensor: torch.Tensor
    compact: bool


@dataclass(frozen=True)
class RankBatch:
    """What one rank was given for a step, checked against what it reads (nothing compared across ranks yet).

    Attributes:
        inputs: per position of the inputs given, the tensor held (None: not given here); None for ``inputs=None``.
        defaulted: the model inputs this rank reads and leaves to their defaults (a shorter tuple).
        targets: the targets held; None for ``targets=None``.
        rows: the batch's global rows, where this rank can tell (an evaluation rank given no tensor and no
            ``batch_size`` cannot).
        ids: the dataset row of each row this rank holds (int64, in either layout), where given.
    """

    inputs: tuple[Held | None, ...] | None
    defaulted: tuple[int, ...]
    targets: tuple[Held, ...] | None
    rows: int | None
    ids: Held | None = None


def rank_batch(data: RankData, arity: Arity, inputs: Any, targets: Any, batch_size: int | None = None,
               any_rows: bool = False, ids: Any = None) -> RankBatch:
    """Check one rank's batch (TypeError/ValueError naming the value) and tell each tensor's layout.

    Args:
        data: what this rank reads.
        arity: how many inputs the model takes.
        inputs: a tensor, a sequence of tensors (None where this rank does not read that input), tensors by
            ``forward``'s argument names (a dict, a ``BatchEncoding``: those the rank does not read may be left
            out), or None.
        targets: a tensor, a sequence of tensors, or None where this rank does not compute the loss.
        batch_size: the batch's global rows (default: the plan's global batch, or with ``any_rows`` the rows of
            the tensors given, read as the whole batch); a training batch's must be the plan's.
        any_rows: an evaluation batch: any positive multiple of the micro-batch size.
        ids: the dataset row of each batch row (global batch) or of each of this rank's rows (own rows), or None.
    """
    labels = None
    if isinstance(inputs, Mapping):  # by name: in the traced model's order, None for one not given here
        labels = [f"inputs[{name!r}]" for name in data.input_names]
        inputs = by_position(inputs, data.input_names, "inputs") if keyword_tensors(inputs, "inputs", True) \
            else None
    xs, ys = _entries(inputs, "inputs", True), _entries(targets, "targets", False)
    if xs is not None and (len(xs) > len(arity.names) or any(data.reads[len(xs):arity.need])):
        arity.check(len(xs), "inputs")  # too many, or fewer than this rank's stage needs: a ValueError
    defaulted = _check_reads(data, xs, ys, labels is not None)
    labels = labels or [f"inputs[{i}]" for i in range(len(xs or ()))]
    held = [(labels[i] if what == "inputs" else f"targets[{i}]", t)
            for what, ts in (("inputs", xs or ()), ("targets", ys or ())) for i, t in enumerate(ts) if t is not None]
    if batch_size is not None:
        data.micro_batches(batch_size)  # ValueError unless a positive multiple of the micro-batch size
        if not any_rows and batch_size != data.global_batch_size:
            raise ValueError(f"batch_size: a training step runs the plan's global batch of {data.global_batch_size} "
                             f"rows (plan.global_batch_size), got {batch_size}")
    known = batch_size if batch_size is not None else None if any_rows else data.global_batch_size
    rows = known if known is not None or not held else _rows_of(*held[0], data.micro_batch_size)
    shape = _Layout(data, rows, known is not None)
    return RankBatch(None if xs is None else tuple(None if t is None else shape.held(t, labels[i])
                                                   for i, t in enumerate(xs)),
                     defaulted, None if ys is None else tuple(shape.held(t, f"targets[{i}]")
                                                              for i, t in enumerate(ys)), rows, _ids(ids, shape))


@overload
def _entries(x: Any, what: str, nones: Literal[False]) -> tuple[torch.Tensor, ...] | None: ...
@overload
def _entries(x: Any, what: str, nones: Literal[True]) -> tuple[torch.Tensor | None, ...] | None: ...
def _entries(x: Any, what: str, nones: bool) -> tuple[torch.Tensor | None, ...] | None:
    """None, or a tensor or a tuple/list of tensors (of tensors or None, with ``nones``) as a tuple."""
    if x is None:
        return None
    xs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    for i, t in enumerate(xs):
        if not isinstance(t, torch.Tensor) and not (nones and t is None):
            hint = f" (pass {what}=None on a rank that does not compute the loss)" if t is None else ""
            raise TypeError(f"{what}[{i}]: expected a tensor, got {type(t).__name__}{hint}")
    return xs


def _check_reads(data: RankData, xs: tuple | None, ys: tuple | None, by_name: bool = False) -> tuple[int, ...]:
    """ValueError where this rank reads an input or the targets it was not given; the inputs it leaves to their
    defaults (positions past the end of a shorter tuple, or of the names given)."""
    where = f"rank {data.rank} (stage {data.stage})"
    for i, (name, reads) in enumerate(zip(data.input_names, data.reads)):
        if reads and (xs is None or (i < len(xs) and xs[i] is None)):
            given = (f"inputs has no {name!r}" if by_name else "inputs is None" if xs is None else
                     f"inputs[{i}] is None")
            raise ValueError(f"{given}, but {where} reads input {i} ({name!r}): pass the global batch or this "
                             f"rank's rows of it (pipe.rows())")
    if data.targets and ys is None:
        raise ValueError(f"targets is None, but {where} is on the last stage and computes the loss: pass the "
                         f"global batch's targets or this rank's rows of them (pipe.rows())")
    return tuple(i for i, reads in enumerate(data.reads) if reads and xs is not None and i >= len(xs))


def _ids(ids: Any, shape: _Layout) -> Held | None:
    """The dataset rows given as ``ids``, as int64 in their layout; None where not given, or empty on a rank that
    holds nothing."""
    if ids is None:
        return None
    t = ids if isinstance(ids, torch.Tensor) else None
    if isinstance(ids, (list, tuple, range)) and all(isinstance(i, Integral) and not isinstance(i, bool) for i in ids):
        t = torch.tensor(list(ids), dtype=torch.long)
    if t is None or t.dim() != 1 or t.dtype not in _INTEGERS:
        raise TypeError(f"ids: expected a 1-D tensor or sequence of ints (the dataset row of each row given), got "
                        f"{type(ids).__name__}{'' if t is None else f' of {t.dtype} {tuple(t.shape)}'}")
    if t.numel() == 0 and not shape.compact:
        return None
    return shape.held(t.long(), "ids")


def _rows_of(what: str, t: torch.Tensor, b: int) -> int:
    """An evaluation batch's rows, read from a tensor taken for the whole batch (``what``: its name)."""
    if t.dim() == 0 or t.shape[0] == 0 or t.shape[0] % b:
        raise ValueError(f"{what} has shape {tuple(t.shape)}; expected a batch of a multiple of "
                         f"plan.micro_batch_size ({b}) rows in dimension 0, the same for every input and target")
    return int(t.shape[0])


class _Layout:
    """Tells a tensor's layout from its rows: the global batch's, or (where the batch's size is known) this
    rank's compact rows; anything else is a ValueError naming both."""

    def __init__(self, data: RankData, rows: int | None, known: bool):
        self.data, self.rows, self.known = data, rows, known
        self.compact = data.row_count(rows) if known and rows is not None and data.loads else None

    def held(self, t: torch.Tensor, what: str) -> Held:
        n = t.shape[0] if t.dim() else None
        if n is not None and n == self.rows:
            return Held(t, False)
        if n is not None and n == self.compact:
            return Held(t, True)
        raise ValueError(f"{what} has shape {tuple(t.shape)}; expected {self._expected()}")

    def _expected(self) -> str:
        d, b = self.data, self.data.micro_batch_size
        if not self.known:
            return (f"a batch of a multiple of plan.micro_batch_size ({b}) rows in dimension 0, the same for every "
                    f"input and target")
        m = d.micro_batches(self.rows)
        whole = (f"the global batch of {self.rows} rows (plan.global_batch_size) in dimension 0, split into {m} "
                 f"micro-batches of {b}" if self.rows == d.global_batch_size else
                 f"the batch of {self.rows} rows (batch_size) in dimension 0, {m} micro-batches of {b}")
        if self.compact is None or self.compact == self.rows:
            return whole
        lo, hi = d.slice
        return (f"{whole}, or this rank's own {self.compact} rows (pipe.rows(): rows {lo}:{hi} of each "
                f"micro-batch, in order)")
