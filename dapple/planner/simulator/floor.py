"""A floor under the simulator's latency of a plan: its compute chains and AllReduces, with no transfer or wait."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.schedule import SPLIT_BACKWARD
from ...core.split_concat import slice_bounds
from ..model.cost import CostModel, layout_of
from .split import split_backward

if TYPE_CHECKING:
    from ...core.plan import Plan


def latency_floor(plan: "Plan", cm: CostModel, overlap: bool = False) -> float:
    """A lower bound on :func:`events.simulate`'s latency of ``plan``: transfers take no time here and nothing
    else waits, so every simulated plan takes at least this long (the search skips simulating a candidate
    whose floor is already above the best simulated).

    For each device of stage s, with forward f and backward b of its slice:
    - its first forward waits for micro-batch 0's forwards in every stage above (the fastest replica of each), W_s;
    - it runs its 2M ops one at a time: W_s + M (f + b);
    - its last forward follows M - 1 forwards and M - K backwards (``core.schedule.stage_ops``: K its warmup, M
      for gpipe), and its last backward (micro-batch M - 1) waits for that micro-batch's round trip through the
      stages below (each stage's fastest F and B): W_s + M f + (M - K) b + the round trip + b;
    - after that backward come the backwards of the stages above, one after another, and (not ``overlap``) its
      stage's AllReduce, which starts once every replica is done.
    With a split backward (zb-h1) the chains above hold for the input-gradient parts B only
    (``split.split_backward``), while the device still runs all of f and b M times (its W's may come after its
    last B, so the stages above wait only for the B's).

    A plan of several chunks per device group gets the floor of :func:`chunked_floor`.

    Args:
        plan: the plan to bound.
        cm: the CostModel of its micro-batch size, as the simulator makes it.
        overlap: AllReduce overlapped with the last backward.
    """
    if plan.chunks.chunks > 1:
        return chunked_floor(plan, cm, overlap)
    M = plan.num_micro_batches
    slices = []  # per stage, per replica: (F, B) ms of its slice
    for st in plan.stages:
        a, c = st.layers
        slices.append([cm.compute_rows(a, c, e - s, st.recompute)
                       for s, e in slice_bounds(plan.micro_batch_size, st.replicas)])
    split = plan.schedule in SPLIT_BACKWARD
    fmin = [min(f for f, _ in fb) for fb in slices]
    shares = [[cm.profile.weight_share(*st.layers, e - s) if split else None
               for s, e in slice_bounds(plan.micro_batch_size, st.replicas)] for st in plan.stages]
    bmin = [min(_chained(s, b, split, w) for (_, b), w in zip(fb, shares[s])) for s, fb in enumerate(slices)]
    floor = above_f = above_b = 0.0  # above: micro-batch 0's forwards and M - 1's backwards in the stages above
    warmups = plan.warmup  # K_i (a Plan sets every stage's)
    for s, st in enumerate(plan.stages):
        below = sum(fmin[s + 1:]) + sum(bmin[s + 1:])  # micro-batch M - 1's round trip below stage s
        k = M if plan.schedule == "gpipe" else max(1, min(warmups[s], M))
        ar = 0.0
        if not overlap and st.replicas > 1:
            ar = cm.ring_allreduce_ms(cm.params(*st.layers), layout_of(cm.cluster, st.devices))
        for (f, b), share in zip(slices[s], shares[s]):
            bc = _chained(s, b, split, share)  # what of its backward the chains wait for
            work = above_f + M * (f + b)  # its ops, one after another
            chain = above_f + M * f + (M - k) * bc + below + bc  # its last backward (split: last B) ends
            last_b = max(above_f + M * (f + bc), chain) if split else max(work, chain)  # split: W's may follow
            floor = max(floor, last_b + above_b, max(work, chain) + ar)
        above_f += fmin[s]
        above_b += bmin[s]
    return floor


def _chained(stage: int, backward_ms: float, split: bool, share: float | None) -> float:
    """The part of a backward that the next stage up waits for: all of it, or a split backward's B."""
    return split_backward(stage, backward_ms, share)[0] if split else backward_ms


def chunked_floor(plan: "Plan", cm: CostModel, overlap: bool = False) -> float:
    """A lower bound on the simulated latency of a plan of chunks: each device runs all its chunks' 2M ops (3M: B
    and W) one at a time, after micro-batch 0's forwards through the stages before its first chunk (the fastest
    replica of each), and (not ``overlap``) its device group's AllReduce after that."""
    M, layout = plan.num_micro_batches, plan.chunks
    fmin = []
    for st in plan.stages:
        a, c = st.layers
        fmin.append(min(cm.compute_rows(a, c, e - s, st.recompute)[0]
                        for s, e in slice_bounds(plan.micro_batch_size, st.replicas)))
    floor = 0.0
    for g, devices in enumerate(layout.groups):
        chunks = layout.stages_of(g)
        ar = 0.0
        if not overlap and len(devices) > 1:
            ar = cm.ring_allreduce_ms(sum(cm.params(*plan.stages[i].layers) for i in chunks),
                                      layout_of(cm.cluster, devices))
        for s, e in slice_bounds(plan.micro_batch_size, len(devices)):
            work = sum(M * sum(cm.compute_rows(*plan.stages[i].layers, e - s, plan.stages[i].recompute))
                       for i in chunks)
            floor = max(floor, sum(fmin[:chunks[0]]) + work + ar)
    return floor
