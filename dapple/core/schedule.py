"""Per-stage operation order of the dapple (early backward, paper V-C) and gpipe schedules."""

from __future__ import annotations

from typing import NamedTuple, Sequence

from .checks import is_int, positive_int

SCHEDULES = ("dapple", "gpipe")
WARMUP_POLICIES = ("A", "B")


class Op(NamedTuple):
    """One computation of one stage: the forward ("F") or backward ("B") of a micro-batch."""

    kind: str
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


def warmup_counts(num_stages: int, num_micro_batches: int, policy: str = "A",
                  max_in_flight: Sequence[int] | int | None = None) -> list[int]:
    """K_i per stage: policy A K_i = min(S-i, D), policy B K_i = min(2(S-i)-1, D) (paper V-C), within [1, M].

    ``max_in_flight`` is D, the number of micro-batch slices whose activations fit in device memory,
    one value for all stages or one per stage. A smaller D on an earlier stage also caps later stages,
    since K_i may never increase along the pipeline (see :func:`validate_warmup`).
    """
    if policy not in WARMUP_POLICIES:
        raise ValueError(f"warmup policy must be one of {WARMUP_POLICIES}, got {policy!r}")
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got S={num_stages}, M={num_micro_batches}")
    if max_in_flight is None or isinstance(max_in_flight, int):
        limits = [max_in_flight] * num_stages
    else:
        limits = list(max_in_flight)
        if len(limits) != num_stages:
            raise ValueError(f"max_in_flight: expected one value per stage ({num_stages}), got {limits}")
    ks = []
    for i in range(num_stages):
        k = num_stages - i if policy == "A" else 2 * (num_stages - i) - 1
        if limits[i] is not None:
            k = min(k, limits[i])
        k = max(1, min(k, num_micro_batches))
        if ks:
            k = min(k, ks[-1])
        ks.append(k)
    return ks


def validate_warmup(warmup: Sequence[int], num_micro_batches: int) -> None:
    """Raise ValueError unless every K_i >= 1 and K_i never increases from one stage to the next.

    Stage i blocks on its first backward after K_i forwards; stage i+1 needs K_{i+1} forwards from
    stage i before it sends that backward, so K_{i+1} > K_i would deadlock, unless K_i >= M (stage i then
    runs every forward first). A K_i above M acts as M (:func:`stage_ops`).
    """
    for i, k in enumerate(warmup):
        if not is_int(k, 1):
            raise ValueError(f"stage {i}: warmup K_{i} must be a positive integer, got {k!r}")
    for i in range(1, len(warmup)):
        if warmup[i] > warmup[i - 1] and warmup[i - 1] < num_micro_batches:
            raise ValueError(f"stage {i}: warmup K_{i}={warmup[i]} exceeds K_{i - 1}={warmup[i - 1]} of the stage "
                             f"before it; K_i must not increase along the pipeline (it would deadlock): "
                             f"got {list(warmup)}")


def stage_ops(schedule: str, num_micro_batches: int, warmup: int) -> list[Op]:
    """The order in which one stage runs its 2M computations.

    dapple: K forwards, then strictly one backward of the oldest micro-batch and one forward, then the
    remaining backwards (at most K micro-batches alive at once). gpipe: all M forwards, then all M
    backwards in the same order.
    """
    m = num_micro_batches
    positive_int("num_micro_batches", m)
    positive_int("warmup", warmup)
    if schedule == "gpipe":
        return [Op("F", j) for j in range(m)] + [Op("B", j) for j in range(m)]
    if schedule != "dapple":
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    k = max(1, min(warmup, m))
    ops = [Op("F", j) for j in range(k)]
    for j in range(m - k):
        ops += [Op("B", j), Op("F", k + j)]
    ops += [Op("B", j) for j in range(m - k, m)]
    return ops


def peak_in_flight(ops: Sequence[Op]) -> int:
    """Peak number of micro-batches whose forward ran and whose backward has not (activations held)."""
    alive = peak = 0
    for op in ops:
        alive += 1 if op.kind == "F" else -1
        peak = max(peak, alive)
    return peak
