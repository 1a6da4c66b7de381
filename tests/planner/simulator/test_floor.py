"""The simulator's floor: never above the simulated latency, and equal to it where nothing but compute waits."""

from __future__ import annotations

import random

import pytest

from dapple import Plan
from dapple.planner import Stage, simulate
from dapple.planner.model.cost import CostModel
from dapple.planner.simulator.floor import latency_floor

from ..helpers import cluster, linear_profile, random_profile


def _random_plan(rng: random.Random, n: int, G: int) -> Plan:
    S = rng.randint(1, min(5, n, G))
    bounds = [0, *sorted(rng.sample(range(1, n), S - 1)), n]
    sizes = [1] * S
    for _ in range(G - S):
        sizes[rng.randrange(S)] += 1
    order = list(range(G))
    if rng.random() < 0.3:
        rng.shuffle(order)  # replicas scattered over the servers
    devs = [order[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(S)]
    M = rng.choice([1, 2, 3, 8, 16])
    return Plan(M * 8, 8, [Stage((bounds[i], bounds[i + 1]), devs[i]) for i in range(S)],
                warmup_policy=rng.choice("AB"), schedule=rng.choice(["dapple", "gpipe", "zb-h1"]))


def test_no_simulation_is_faster_than_the_floor():
    """Over 200 random plans (1 to 5 stages, either schedule and warmup policy, overlapped AllReduce or not, links
    held or shared, fast and slow links), the simulated latency is at least the floor (which leaves out the
    transfers: on links this slow it can be far below)."""
    rng = random.Random(7)
    exact = 0
    for _ in range(200):
        prof = random_profile(rng, rng.randint(2, 8))
        servers, per = rng.choice([(1, 4), (2, 2), (2, 4), (4, 1)])
        c = cluster(servers, per, intra=rng.choice([5e10, 1e10]), inter=rng.choice([3e9, 1e9, 1e8]), intra_lat=5e-6,
                    inter_lat=3e-5, link_sharing=rng.choice(["held", "shared"]))
        plan = _random_plan(rng, prof.num_layers, c.num_devices)
        overlap = rng.random() < 0.5
        floor = latency_floor(plan, CostModel(prof, c, plan.micro_batch_size), overlap)
        sim = simulate(plan, prof, c, overlap=overlap).latency_ms
        assert floor <= sim * (1 + 1e-12), (plan, overlap, floor, sim)
        exact += floor == pytest.approx(sim)
    assert exact >= 10  # one stage, one device, ...: the floor is what the simulator finds


@pytest.mark.parametrize("schedule", ["dapple", "gpipe"])
@pytest.mark.parametrize("S, M", [(1, 4), (3, 8), (4, 3)])
def test_the_floor_is_the_simulation_where_only_compute_waits(schedule, S, M):
    """Equal single-device stages without communication: (M + S - 1)(F + B) for both schedules, as simulated."""
    prof = linear_profile([1.0] * S)  # F = 8 ms, B = 16 ms per stage of one layer (8 rows)
    c = cluster(1, S, intra=1e30, inter=1e30)
    plan = Plan(M * 8, 8, [Stage((i, i + 1), [i]) for i in range(S)], warmup_policy="A", schedule=schedule)
    floor = latency_floor(plan, CostModel(prof, c, 8))
    assert floor == pytest.approx((M + S - 1) * 24.0)
    assert floor == pytest.approx(simulate(plan, prof, c).latency_ms)


def test_the_floor_counts_the_allreduce_after_the_last_backward():
    """One stage on two devices: 2M ops and then its AllReduce, unless it overlaps the last backward."""
    prof = linear_profile([1.0, 1.0], params=1e9)
    c = cluster(1, 2, intra=1e10, inter=1e10)
    plan = Plan(32, 8, [Stage((0, 2), [0, 1])], warmup_policy="A")
    cm = CostModel(prof, c, 8)
    f, b = cm.compute_rows(0, 2, 4)
    ar = cm.ring_allreduce_ms(cm.params(0, 2), (0, 0))
    assert ar > 100
    assert latency_floor(plan, cm) == pytest.approx(4 * (f + b) + ar)
    assert latency_floor(plan, cm) == pytest.approx(simulate(plan, prof, c).latency_ms)
    assert latency_floor(plan, cm, overlap=True) == pytest.approx(4 * (f + b))
