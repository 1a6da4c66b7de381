"""Per-stage operation order of the dapple (early backward, paper V-C), gpipe and zero-bubble (zb-h1) schedules; the
names of the schedules of several chunks per device group too (their order: core.chunk_schedule)."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from .checks import is_int, positive_int

STAGE_SCHEDULES = ("dapple", "gpipe", "zb-h1")  # one stage per device group: stage_ops
CHUNKED_SCHEDULES = ("interleaved-1f1b", "zb-v")  # several chunks per device group: core.chunk_schedule.rank_ops
SCHEDULES = STAGE_SCHEDULES + CHUNKED_SCHEDULES
SPLIT_BACKWARD = ("zb-h1", "zb-v")  # schedules whose backward is an input-gradient B and a later weight-gradient W
WARMUP_POLICIES = ("A", "B")


class Op(NamedTuple):
    """One computation of one stage for a micro-batch: its forward ("F"), backward ("B"), or, in a split-backward
    schedule (:data:`SPLIT_BACKWARD`), its input-gradient backward ("B") and later weight-gradient backward ("W")."""

    kind: str
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


def policy_warmup(policy: str, stages: int) -> int:
    """K_i by the warmup policy alone, for a stage with ``stages`` = S - i stages from it to the last (itself
    included): S - i (policy A) or 2(S - i) - 1 (policy B, never the smaller)."""
    return stages if policy == "A" else 2 * stages - 1


def most_warmup(stages: int, max_in_flight: int, num_micro_batches: int) -> int:
    """The most K_i can be under either policy (B's), with ``stages`` = S - i stages from stage i to the last, D
    slices that fit (at least 1) and M micro-batches: what a lower bound on a plan's latency may assume."""
    d = max_in_flight if max_in_flight > 1 else 1
    return min(num_micro_batches, d, policy_warmup("B", stages))


def most_warmups(count: int, max_in_flight: int, num_micro_batches: int) -> list[int]:
    """[most_warmup(s, D, M) for s = 1 .. count] (policy B's K_i, written out: the search asks for many)."""
    cap = min(num_micro_batches, max_in_flight if max_in_flight > 1 else 1)
    return [2 * s - 1 if 2 * s - 1 < cap else cap for s in range(1, count + 1)]


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
    ks, prev = [], num_micro_batches  # (the planner prices many plans: comparisons, not min and max calls)
    for i, limit in enumerate(limits):
        k = policy_warmup(policy, num_stages - i)
        if limit is not None and limit < k:
            k = limit
        if prev < k:  # at most M, and never more than the stage before
            k = prev
        if k < 1:
            k = 1
        ks.append(k)
        prev = k
    return ks


def validate_warmup(warmup: Sequence[Any], num_micro_batches: int) -> None:  # any values: checked here
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


def stage_ops(schedule: str, num_micro_batches: int, warmup: int, hold: int | None = None) -> list[Op]:
    """The order in which one stage runs its computations.

    dapple: K forwards, then strictly one backward of the oldest micro-batch and one forward, then the
    remaining backwards (at most K micro-batches alive at once). gpipe: all M forwards, then all M
    backwards in the same order. zb-h1 (zero bubble, Qi et al. ICLR'24, H1): dapple's order of forwards and
    input-gradient backwards B, each micro-batch's weight-gradient backward W deferred while fewer than
    ``hold - K`` micro-batches wait for theirs, the rest after the last B (into the cool-down bubble).

    Args:
        schedule: one of :data:`STAGE_SCHEDULES`.
        num_micro_batches: M.
        warmup: the stage's K_i (forwards before its first backward); above M acts as M.
        hold: zb-h1 only: the most micro-batches whose forward ran and whose W has not (their activations are
            held until W), at least K_i; :func:`stage_holds` gives K_0 to every stage, the first stage's peak
            under dapple, so no stage holds more than the pipeline's peak of 1F1B. Default: K_i (no deferral).
    """
    m = num_micro_batches
    positive_int("num_micro_batches", m)
    positive_int("warmup", warmup)
    if schedule == "gpipe":
        return [Op("F", j) for j in range(m)] + [Op("B", j) for j in range(m)]
    if schedule not in STAGE_SCHEDULES:
        raise ValueError(f"schedule must be one of {STAGE_SCHEDULES}, got {schedule!r}"
                         + (" (a schedule of several chunks per device group: core.chunk_schedule.rank_ops, "
                            "Plan.rank_ops)" if schedule in CHUNKED_SCHEDULES else ""))
    k = max(1, min(warmup, m))
    order = [Op("F", j) for j in range(k)]
    for j in range(m - k):
        order += [Op("B", j), Op("F", k + j)]
    order += [Op("B", j) for j in range(m - k, m)]
    if schedule == "dapple":
        return order
    if hold is not None:
        positive_int("hold", hold)
    return _defer_weights(order, max(k, min(m, hold if hold is not None else k)) - k)


def _defer_weights(order: list[Op], defer: int) -> list[Op]:
    """Insert each W after the B that leaves more than ``defer`` micro-batches waiting for their W (before the
    next forward), the remaining ones after the last B."""
    ops: list[Op] = []
    done_b = done_w = 0
    for op in order:
        ops.append(op)
        if op.kind == "B":
            done_b += 1
            while done_b - done_w > defer:
                ops.append(Op("W", done_w))
                done_w += 1
    ops += [Op("W", j) for j in range(done_w, done_b)]
    return ops


def stage_holds(warmup: Sequence[int], num_micro_batches: int) -> list[int]:
    """zb-h1's ``hold`` per stage: the largest K of the stages up to it (K_0 when K_i does not increase), at most M.

    Deferring a later stage's W up to the first stage's K keeps every stage within the peak of activations that
    dapple's schedule has on its first stage, while those later stages reach their B sooner.
    """
    holds, top = [], 0
    for k in warmup:
        top = max(top, min(k, num_micro_batches))
        holds.append(top)
    return holds


def peak_in_flight(ops: Sequence[Op]) -> int:
    """Peak number of micro-batches whose forward ran and whose backward has not (activations held); with W ops
    (split backward), held until the W: a B frees nothing, since W needs what the forward saved."""
    release = "W" if any(op.kind == "W" for op in ops) else "B"
    alive = peak = 0
    for op in ops:
        alive += 1 if op.kind == "F" else -1 if op.kind == release else 0
        peak = max(peak, alive)
    return peak


def pipeline_stage_ops(schedule: str, num_micro_batches: int, warmup: Sequence[int], stage: int) -> list[Op]:
    """:func:`stage_ops` of stage ``stage`` in a pipeline whose stages have K_i ``warmup`` (zb-h1: each stage's
    ``hold`` from :func:`stage_holds`)."""
    hold = stage_holds(warmup, num_micro_batches)[stage] if schedule in SPLIT_BACKWARD else None
    return stage_ops(schedule, num_micro_batches, warmup[stage], hold)
