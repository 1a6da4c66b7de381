"""Event simulator on plans of several chunks per device group: interleaved-1f1b and zb-v as the runtime orders
them, hand-offs between a device's own chunks, every chunk's activations in flight, one AllReduce per group."""

from __future__ import annotations

import random

import pytest

from dapple import Plan
from dapple.core.chunk_schedule import PLACEMENT_OF, peak_held
from dapple.core.chunks import group_order
from dapple.planner import Stage, simulate
from dapple.planner.model.cost import CostModel
from dapple.planner.simulator.floor import latency_floor
from dapple.planner.simulator.gantt import device_labels

from ..helpers import cluster, linear_profile, random_profile

CHUNKED = ("interleaved-1f1b", "zb-v")


def chunked_plan(schedule: str, groups: list[list[int]], M: int, micro: int = 8, chunks: int = 2,
                 layers: list[tuple[int, int]] | None = None) -> Plan:
    """``groups`` (device ids each) holding ``chunks`` chunks in ``schedule``'s order; one layer per chunk unless
    ``layers`` says."""
    order = group_order(len(groups), chunks, PLACEMENT_OF[schedule])
    spans = layers or [(i, i + 1) for i in range(len(order))]
    return Plan(M * micro, micro, [Stage(s, list(groups[g])) for s, g in zip(spans, order)], schedule=schedule)


def random_chunked(rng: random.Random, n: int, G: int) -> Plan:
    """Random device groups (uneven replicas) of two chunks in the loop or V order, random cuts of ``n`` layers."""
    P = rng.randint(2, min(G, n // 2))
    sizes = [1] * P
    for _ in range(G - P):
        sizes[rng.randrange(P)] += 1
    devs = list(range(G))
    rng.shuffle(devs)
    groups = [devs[sum(sizes[:g]):sum(sizes[:g + 1])] for g in range(P)]
    cuts = [0, *sorted(rng.sample(range(1, n), 2 * P - 1)), n]
    layers = [(cuts[i], cuts[i + 1]) for i in range(2 * P)]
    return chunked_plan(rng.choice(CHUNKED), groups, rng.choice([1, 2, 3, 4, 8]), layers=layers)


@pytest.mark.parametrize("P, M", [(2, 4), (4, 8), (3, 6)])
def test_interleaved_shrinks_the_bubble_by_the_chunks(P, M):
    """Equal chunks, free transfers: one stage per device takes (M + P - 1) (F + B) of its stage; two chunks take
    2 M (f + b) + (P - 1) (f + b) of a chunk (Megatron's bubble, divided by v); zb-v is faster still."""
    prof = linear_profile([1.0] * (2 * P))  # f = 8, b = 16 ms per layer and micro-batch of 8 rows
    c = cluster(1, P)
    one = Plan(M * 8, 8, [Stage((2 * i, 2 * i + 2), [i]) for i in range(P)])
    assert simulate(one, prof, c).latency_ms == pytest.approx((M + P - 1) * 48)
    inter = simulate(chunked_plan("interleaved-1f1b", [[d] for d in range(P)], M), prof, c).latency_ms
    assert inter == pytest.approx(2 * M * 24 + (P - 1) * 24)
    zbv = simulate(chunked_plan("zb-v", [[d] for d in range(P)], M), prof, c).latency_ms
    assert 2 * M * 24 <= zbv < inter


@pytest.mark.parametrize("schedule", CHUNKED)
def test_every_device_runs_its_groups_order(schedule):
    """Each device's ops are its group's rank_ops, in that order, each chunk on its own rows."""
    plan = chunked_plan(schedule, [[0, 1], [2]], 4)
    sim = simulate(plan, linear_profile([1.0] * 4, boundary=1e4), cluster(1, 3))
    for d in range(3):
        ran = [(o.stage, o.kind, o.micro_batch) for o in sim.device_timeline(d) if o.kind != "AR"]
        assert ran == [(op.stage, op.kind, op.micro_batch) for op in plan.rank_ops(d)]
        assert sim.stages_of_device[d] == plan.stages_of_device(d)
    assert {o.rows for o in sim.ops if o.device == 0 and o.kind == "F"} == {4}  # a replica's slice


@pytest.mark.parametrize("schedule", CHUNKED)
def test_memory_counts_every_chunks_activations_in_flight(schedule):
    """max_alive counts the micro-batches of all a device's chunks (until their B, or W under zb-v): the order's
    peak, above what one stage per device holds."""
    P, M = 4, 8
    plan = chunked_plan(schedule, [[d] for d in range(P)], M)
    sim = simulate(plan, linear_profile([1.0] * (2 * P)), cluster(1, P))
    one = simulate(Plan(M * 8, 8, [Stage((2 * i, 2 * i + 2), [i]) for i in range(P)]),
                   linear_profile([1.0] * (2 * P)), cluster(1, P))
    for d in range(P):
        assert sim.max_alive(d) == peak_held(plan.rank_ops(d))
    assert sim.max_alive(0) > one.max_alive(0)


def test_hand_offs_between_a_devices_own_chunks_take_no_link():
    """zb-v's V turns on the last group: its chunks P - 1 and P hand over without a transfer; every other cut
    crosses a link in each direction once per micro-batch."""
    P, M = 3, 4
    plan = chunked_plan("zb-v", [[d] for d in range(P)], M)
    sim = simulate(plan, linear_profile([1.0] * (2 * P), boundary=1e5), cluster(1, P))
    assert all(t.device != t.peer for t in sim.transfers)
    assert len(sim.transfers) == 2 * M * (2 * P - 2)  # 2P - 1 cuts, one of them inside device P - 1


def test_a_replicated_groups_chunks_are_reduced_together():
    """A group of two replicas holding two chunks AllReduces the gradients of both, once (its buckets), after the
    last backward of the group's first chunk; a group of one device reduces nothing."""
    prof = linear_profile([1.0] * 4, params=[4e7, 1e7, 2e7, 3e7])
    plan = chunked_plan("interleaved-1f1b", [[0, 1], [2]], 4)
    sim = simulate(plan, prof, cluster(1, 3), overlap=True)
    ar = [o for o in sim.ops if o.kind == "AR"]
    assert {o.device for o in ar} == {0, 1}
    assert sum(o.nbytes for o in ar if o.device == 0) == pytest.approx(4e7 + 2e7)  # stages 0 and 2
    last_b = max(o.end_ms for o in sim.ops if o.device in (0, 1) and o.kind == "B" and o.stage == 0)
    assert max(o.end_ms for o in ar) >= last_b


def test_a_plan_of_chunks_runs_only_under_a_schedule_of_chunks():
    plan = chunked_plan("zb-v", [[0], [1]], 2)
    with pytest.raises(ValueError, match="several chunks per device group"):
        simulate(plan, linear_profile([1.0] * 4), cluster(1, 2), schedule="dapple")
    one = Plan(16, 8, [Stage((0, 2), [0]), Stage((2, 4), [1])])
    with pytest.raises(ValueError, match="cannot run the plan's stages"):
        simulate(one, linear_profile([1.0] * 4), cluster(1, 2), schedule="zb-v")


def test_no_chunked_simulation_is_faster_than_the_floor():
    rng = random.Random(5)
    for _ in range(40):
        prof = random_profile(rng, rng.randint(4, 9))
        c = cluster(rng.choice([1, 2]), rng.choice([2, 3]), inter=rng.choice([1e9, 3e8]))
        plan = random_chunked(rng, prof.num_layers, c.num_devices)
        overlap = rng.random() < 0.5
        cm = CostModel(prof, c, plan.micro_batch_size)
        sim = simulate(plan, prof, c, overlap=overlap).latency_ms
        assert latency_floor(plan, cm, overlap) <= sim * (1 + 1e-9), plan


def test_the_chart_names_every_chunk_of_a_device():
    sim = simulate(chunked_plan("zb-v", [[0], [1]], 2), linear_profile([1.0] * 4), cluster(1, 2))
    assert device_labels(sim) == {0: "device 0 · stages 0, 3", 1: "device 1 · stages 1, 2"}
