"""The op order of a device group holding several chunks: interleaved 1F1B (loop) and V-shaped zero bubble (ZB-V).

A group's ops are :class:`ChunkOp`: an op of :mod:`core.schedule` with the stage (chunk) it runs on. The group
with index g of P groups of v chunks runs (``rank_ops``):

- ``interleaved-1f1b`` (Narayanan et al., SC'21, Megatron-LM's order; loop placement): forwards in rounds of P
  micro-batches, chunk after chunk (micro-batches 0..P-1 on chunk 0, the same on chunk 1, ..., then the next P),
  backwards in the same rounds with the chunks reversed; ``(v - 1) P + 2 (P - 1 - g)`` forwards first, then one
  forward and one backward alternately, then the remaining backwards. Where P does not divide M: max(1, M // P)
  rounds of R or R + 1 micro-batches (R = M // rounds, as torch.distributed.pipelining makes them where they come
  out even), ``(v - 1) R + 2 (P - 1 - g)`` forwards first.
- ``zb-v`` (Qi et al., ICLR'24, section 6, as torch.distributed.pipelining's ScheduleZBVZeroBubble builds it; V
  placement, two chunks): each backward split into B (input gradients) and W (weight gradients); the chunk on the
  way down (stage g) warms up with 2(P - g) - 1 forwards, the chunk on the way up (stage 2P - 1 - g) joins, and in
  the steady state each chunk runs F, B, W in turn; some W wait for the cool-down. Micro-batches beyond M of its
  construction (it needs 2P - 1) are left out, which keeps the order of the others.

Each chunk's K_i (``chunk_warmups``) is what the order gives it: its forwards before its first backward.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from .checks import positive_int
from .schedule import CHUNKED_SCHEDULES, Op

INTERLEAVED, ZB_V = CHUNKED_SCHEDULES
PLACEMENT_OF = {INTERLEAVED: "loop", ZB_V: "V"}  # the chunk order each schedule runs (core.chunks)


class ChunkOp(NamedTuple):
    """One computation of one chunk: ``kind`` "F", "B" (split backward: input gradients) or "W" (weight gradients)
    of micro-batch ``micro_batch`` on stage ``stage``; printed ``F3@s5``."""

    kind: str
    micro_batch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}@s{self.stage}"

    @property
    def op(self) -> Op:
        """The op without its stage."""
        return Op(self.kind, self.micro_batch)


def rank_ops(schedule: str, num_micro_batches: int, groups: int, chunks: int, group: int) -> list[ChunkOp]:
    """The ops device group ``group`` (0 .. ``groups`` - 1) runs in one step, in order.

    Args:
        schedule: one of :data:`CHUNKED_SCHEDULES`.
        num_micro_batches: M.
        groups: P, the device groups.
        chunks: v, the chunks on each group (zb-v: 2).
        group: which group.
    """
    positive_int("num_micro_batches", num_micro_batches)
    positive_int("groups", groups)
    if not 0 <= group < groups:
        raise ValueError(f"group: expected 0..{groups - 1}, got {group!r}")
    if schedule == INTERLEAVED:
        positive_int("chunks", chunks)
        return interleaved_ops(num_micro_batches, groups, chunks, group)
    if schedule == ZB_V:
        if chunks != 2:
            raise ValueError(f"zb-v runs two chunks per device group (the V), got {chunks}")
        return zbv_ops(num_micro_batches, groups, group)
    raise ValueError(f"schedule: expected one of {CHUNKED_SCHEDULES}, got {schedule!r}")


def round_sizes(m: int, groups: int) -> list[int]:
    """The micro-batches of each round: max(1, M // P) rounds, as even as may be, the larger first (R = M // rounds
    each where that divides M, as torch.distributed.pipelining's ScheduleInterleaved1F1B makes them). Never fewer
    than P a round where M >= P: Megatron's rounds of P with a short last one deadlock (e.g. P = 5, M = 7)."""
    rounds = max(1, m // groups)
    return [m // rounds + (1 if r < m % rounds else 0) for r in range(rounds)]


def forward_order(m: int, groups: int, chunks: int) -> list[tuple[int, int]]:
    """Megatron's order of a group's forwards, as (micro-batch, chunk): in rounds (:func:`round_sizes`), chunk after
    chunk within each."""
    out, first = [], 0
    for size in round_sizes(m, groups):
        out += [(j, c) for c in range(chunks) for j in range(first, first + size)]
        first += size
    return out


def interleaved_warmup(m: int, groups: int, chunks: int, group: int) -> int:
    """The forwards group ``group`` runs before its first backward's turn: (v - 1) R + 2 (P - 1 - g) with R the first
    round's micro-batches (P where P divides M), at most v M."""
    return min(chunks * m, (chunks - 1) * round_sizes(m, groups)[0] + 2 * (groups - 1 - group))


def interleaved_ops(m: int, groups: int, chunks: int, group: int) -> list[ChunkOp]:
    """interleaved-1f1b's ops of group ``group`` (loop placement: its chunk c is stage c P + g)."""
    order = forward_order(m, groups, chunks)
    fwd = [ChunkOp("F", j, c * groups + group) for j, c in order]
    bwd = [ChunkOp("B", j, (chunks - 1 - c) * groups + group) for j, c in order]
    warm = interleaved_warmup(m, groups, chunks, group)
    ops = fwd[:warm]
    for k in range(len(fwd) - warm):  # one forward, then one backward
        ops += [fwd[warm + k], bwd[k]]
    return ops + bwd[len(fwd) - warm:]


def zbv_ops(m: int, groups: int, group: int) -> list[ChunkOp]:
    """zb-v's ops of group ``group`` (V placement: stages g and 2P - 1 - g)."""
    p, g = groups, group
    n = max(2 * p - 1, m)  # the construction fills the pipeline; micro-batches from m on are dropped below
    down, up = g, 2 * p - 1 - g
    count = {(down, "F"): 0, (down, "B"): 0, (down, "W"): 0, (up, "F"): 0, (up, "B"): 0, (up, "W"): 0}
    ops: list[ChunkOp] = []

    def run(stage: int, *kinds: str) -> None:
        for kind in kinds:
            ops.append(ChunkOp(kind, count[(stage, kind)], stage))
            count[(stage, kind)] += 1

    for _ in range(2 * (p - g) - 1):  # warm-up: the way down, then both chunks, then the way up with its B, W
        run(down, "F")
    for _ in range(g):
        run(up, "F")
        run(down, "F")
    for _ in range(p - g):
        run(up, "F", "B", "W")
    while count[(up, "F")] < count[(down, "F")] or count[(down, "F")] < n:  # steady: F, B, W of each in turn
        if count[(down, "F")] < n:
            run(down, "F")
        run(down, "B", "W")
        run(up, "F", "B", "W")
    for _ in range(g):  # cool-down: input gradients first, weight gradients where they fit
        run(down, "B")
        run(up, "B")
    for _ in range(p - g):
        run(down, "B", "W")
    for stage in (up, down):
        while count[(stage, "W")] < count[(stage, "B")]:
            run(stage, "W")
    return [op for op in ops if op.micro_batch < m]


def chunk_warmups(ops: Sequence[ChunkOp]) -> dict[int, int]:
    """Per stage of ``ops``, its K_i: the forwards it runs before its first backward (all of them if none)."""
    forwards: dict[int, int] = {}
    started: set[int] = set()
    for op in ops:
        if op.kind == "F" and op.stage not in started:
            forwards[op.stage] = forwards.get(op.stage, 0) + 1
        elif op.kind != "F":
            started.add(op.stage)
    return forwards


def peak_held(ops: Sequence[ChunkOp], weight: Callable[[int], float] = lambda stage: 1.0,
              release: Callable[[int], str] | None = None) -> float:
    """The most a group holds at once of micro-batches whose forward ran and whose backward has not (a split
    backward: whose W has not; W needs what the forward saved), each counted ``weight(stage)`` (1: chunks).
    ``release(stage)``: the op that frees a stage's micro-batch ("B": a recomputing stage runs its whole backward
    in B); default "W" where the ops have W, else "B"."""
    kind = "W" if any(op.kind == "W" for op in ops) else "B"
    frees = release or (lambda stage: kind)
    alive = peak = 0.0
    for op in ops:
        if op.kind == "F":
            alive += weight(op.stage)
            peak = max(peak, alive)
        elif op.kind == frees(op.stage):
            alive -= weight(op.stage)
    return peak
