"""AllReduce of a few control values (batch agreement, loss, flags): recursive doubling over P2P on gloo."""

# gloo's AllReduce is a ring of 2 (P - 1) hops, each a thread wake-up, where log2(P) rounds of pairwise exchange
# do (the step's cost: benchmarks/RESULTS.md, "Schedule efficiency"). NCCL's AllReduce of a small vector is one
# kernel: there dist.all_reduce is used as it is.
#
#     P = 4:  round 1  0 <-> 1   2 <-> 3        P = 5:  4 -> 0 (folded in), rounds 1-2 on 0..3, then 0 -> 4
#             round 2  0 <-> 2   1 <-> 3
#
# Both ranks of a pair combine the lower rank's vector with the higher's, in that order: every rank ends with the
# same bits.

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..core.dist import PipelineError, first_line
from .roll import missing, post, waited

TAG = 0x6470  # the P2P tag of these exchanges on the default group, apart from the activations (tag 0) on it
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def reduce_small(x: torch.Tensor, op: str, timeout: float, who: str, place: str, ranks: Sequence[int],
                 group: Any = None) -> None:
    """AllReduce ``x`` in place over ``group`` (default: every rank; ``ranks``, its global ranks) with ``op``
    ("sum" or "max"), every wait bounded by ``timeout`` seconds; a failure is a PipelineError that begins
    "``who``, ``place``" and names the peer and the ranks that were elsewhere.

    On gloo with a CPU tensor: recursive doubling over P2P (every rank gets the same bits); otherwise (NCCL, a
    device tensor) ``dist.all_reduce``."""
    if op not in OPS:
        raise ValueError(f"reduce_small: expected op 'sum' or 'max', got {op!r}")
    if x.device.type != "cpu" or dist.get_backend(group) != "gloo" or len(ranks) == 1:
        waited(dist.all_reduce(x, op=OPS[op], group=group, async_op=True), timeout, who, place, ranks)
        return
    post(who, place)
    link = _Link(group, timeout, f"{who}, {place}", place, tuple(ranks))
    me = dist.get_rank(group)
    p2 = 1 << (len(ranks).bit_length() - 1)  # the largest power of two <= the group's size
    combine = torch.add if op == "sum" else torch.maximum
    if me >= p2:  # folded into rank me - p2 before the rounds, given the result after them
        link.exchange(me - p2, out=x)
        link.exchange(me - p2, into=x)
        return
    if me + p2 < len(ranks):
        x.copy_(combine(x, link.exchange(me + p2, into=torch.empty_like(x))))
    d = 1
    while d < p2:
        got = link.exchange(me ^ d, out=x, into=torch.empty_like(x))
        x.copy_(combine(x, got) if me < me ^ d else combine(got, x))  # the same operand order on both sides
        d *= 2
    if me + p2 < len(ranks):
        link.exchange(me + p2, out=x)


@dataclass(frozen=True)
class _Link:
    """What one reduction's exchanges share: the group, the timeout, and words for errors."""

    group: Any
    timeout: float
    where: str  # "<who>, <place>"
    place: str
    ranks: tuple[int, ...]  # global rank of each group rank

    def exchange(self, peer: int, out: torch.Tensor | None = None, into: torch.Tensor | None = None) -> Any:
        """Send ``out`` to and receive ``into`` from group rank ``peer`` (either may be None); returns ``into``."""
        works = []
        try:
            if into is not None:
                works.append(dist.irecv(into, src=self.ranks[peer], group=self.group, tag=TAG))
            if out is not None:
                works.append(dist.isend(out.contiguous(), dst=self.ranks[peer], group=self.group, tag=TAG))
            for w in works:
                if w is not None and w.wait(timeout=timedelta(seconds=self.timeout)) is False:
                    raise RuntimeError("the wait returned False")
        except Exception as e:
            raise PipelineError(f"{self.where} failed or timed out (timeout {self.timeout:g}s): the exchange with rank "
                                f"{self.ranks[peer]}: {first_line(e)}{missing(self.place, self.ranks)}") from e
        return into
