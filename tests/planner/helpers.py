"""Small synthetic profiles and clusters for planner tests (pure Python, no torch)."""

from __future__ import annotations

import random
from typing import Sequence

from dapple import Cluster, Profile
from dapple.planner.judge import Candidate
from dapple.profiler import LayerProfile


def linear_profile(forward: Sequence[float], params: Sequence[float] | float = 0.0,
                   boundary: Sequence[float] | float = 0.0, saved: Sequence[float] | float = 0.0,
                   batch: int = 8) -> Profile:
    """Costs proportional to the batch (one profiled size): per-row values times rows; backward = 2 x forward."""
    n = len(forward)

    def each(x):
        return list(x) if isinstance(x, (list, tuple)) else [x] * n

    params, boundary, saved = each(params), each(boundary), each(saved)
    layers = [LayerProfile(f"layer{i}", [forward[i] * batch], [2 * forward[i] * batch], [boundary[i] * batch],
                           [saved[i] * batch], int(params[i])) for i in range(n)]
    return Profile("linear", "synthetic", [batch], layers)


def random_profile(rng: random.Random, n: int) -> Profile:
    """Layers with varied compute, parameters and activations, profiled at batch 4 and 8 (with intercepts)."""
    layers = []
    for i in range(n):
        f = rng.uniform(0.5, 3.0)
        act = rng.choice([1e4, 1e6, 2e7, 1e8])
        par = rng.choice([0, 1e6, 5e7, 3e8, 1e9])
        layers.append(LayerProfile(f"l{i}", [f, 1.9 * f], [2 * f, 3.7 * f], [act, 2 * act], [2 * act, 4 * act],
                                   int(par)))
    return Profile("random", "synthetic", [4, 8], layers)


def cluster(servers: int, per_server: int, intra: float = 1e10, inter: float = 1e9, intra_lat: float = 0.0,
            inter_lat: float = 0.0, memory: float = 1e12, link_sharing: str = "held") -> Cluster:
    return Cluster(servers, per_server, intra, inter, intra_lat, inter_lat, memory, name=f"{servers}x{per_server}",
                   link_sharing=link_sharing)


def random_candidates(rng: random.Random, n: int = 6) -> list[Candidate]:
    """``n`` candidates of an 8-layer model on 2 x 2 devices (devices per stage from a few layouts, random cuts and
    micro-batch sizes), with made-up latencies 100, 101, ... for the judge to check."""
    layouts = [((0, 0, 1, 1),), ((0, 0), (1, 1)), ((0, 1), (0, 1)), ((0,), (0,), (1, 1)), ((0,), (0,), (1,), (1,))]
    cands = []
    for k in range(n):
        lays = rng.choice(layouts)
        cuts = [0, *sorted(rng.sample(range(1, 8), len(lays) - 1)), 8]
        spans = tuple((cuts[s], cuts[s + 1], lay) for s, lay in enumerate(lays))
        cands.append(Candidate(100.0 + k, rng.choice([b for b in (2, 4, 8, 16) if b >= max(map(len, lays))]),
                               spans, ("even",) * len(lays)))
    return cands


def small_instances(seed: int, n: int, max_layers: int = 6, inter: Sequence[float] = (3e9, 1e9),
                    memory: Sequence[float] = (16e9, 8e9, 3e9), batches: Sequence[int] = (16, 32, 64),
                    micro: Sequence[int] = (4, 8), min_layers: int = 2,
                    shapes: Sequence[tuple[int, int]] = ((1, 4), (2, 2), (4, 1))):
    """(profile, cluster, global batch, micro-batch) for brute-force comparisons: ``min_layers`` to
    ``max_layers`` layers on servers x devices per server drawn from ``shapes`` (4 devices by default)."""
    rng = random.Random(seed)
    for _ in range(n):
        prof = random_profile(rng, rng.randint(min_layers, max_layers))
        servers, per = rng.choice(list(shapes))
        c = cluster(servers, per, intra=rng.choice([5e10, 1e10]), inter=rng.choice(list(inter)), intra_lat=5e-6,
                    inter_lat=3e-5, memory=rng.choice(list(memory)))
        yield prof, c, rng.choice(list(batches)), rng.choice(list(micro))


def pivot_hides_allreduce() -> tuple[Profile, Cluster, int, int]:
    """(profile, cluster, global batch, micro-batch) where formula 2's best plan, [0, 1) | [1, 5) on 2 | [5, 6), has
    its pivot at stage 0, barely heavier than stage 1, whose 29.5 ms AllReduce Te then hides behind the backwards:
    stage 1's M (F + B) + AllReduce is far above the plan's L (97.03 ms)."""
    rows = [([1.902143, 3.754287], [3.804287, 7.508573], [25000, 50000], [75000, 150000], 10000000),
            ([1.241629, 2.433259], [2.483259, 4.866518], [2000000, 4000000], [6000000, 12000000], 1000000),
            ([1.042648, 2.035296], [2.085296, 4.070592], [250000, 500000], [750000, 1500000], 1000000),
            ([0.444952, 0.839904], [0.889904, 1.679808], [250000, 500000], [750000, 1500000], 10000000),
            ([1.010962, 1.971923], [2.021923, 3.943846], [2000000, 4000000], [6000000, 12000000], 80000000),
            ([1.284402, 2.518804], [2.568804, 5.037608], [2000000, 4000000], [6000000, 12000000], 10000000)]
    prof = Profile("hidden", "synthetic", [4, 8], [LayerProfile(f"layer{i}", *row) for i, row in enumerate(rows)])
    c = Cluster(servers=4, devices_per_server=1, intra_bandwidth=1e11, inter_bandwidth=3.125e9, intra_latency=5e-6,
                inter_latency=3e-5, device_memory=1.6e10)
    return prof, c, 64, 8


def hidden_allreduce_instances(seed: int, n: int):
    """(profile, cluster, global batch 64, micro-batch 8) of :func:`pivot_hides_allreduce`'s kind: a first layer
    slightly heavier than the middle layers on two replicas (formula 2 may take it as the pivot), one middle layer
    of 50 to 200 MB of parameters (an AllReduce Te may hide) and a lighter last layer, on 4 devices (4 x 1 or
    2 x 2)."""
    rng = random.Random(seed)
    for _ in range(n):
        layers = rng.randint(4, 6)
        f0 = rng.uniform(1.5, 2.5)  # ms at 8 rows; 1.97 x the time at 4
        share = [rng.uniform(0.5, 1.5) for _ in range(layers - 2)]
        middle = 1.97 * f0 * (1 - rng.uniform(0.002, 0.02))  # at 8 rows: on 2 replicas, just below the first
        fs = [f0] + [middle * s / sum(share) for s in share] + [f0 * rng.uniform(0.5, 0.9)]
        heavy = rng.randrange(1, layers - 1)
        prof = []
        for i, f in enumerate(fs):
            params = rng.uniform(5e7, 2e8) if i == heavy else rng.choice([1e6, 1e7])
            act = 5e4 if i == 0 else rng.choice([5e5, 4e6])  # (little crosses after the first)
            prof.append(LayerProfile(f"layer{i}", [f / 1.97, f], [2 * f / 1.97, 2 * f], [act / 2, act],
                                     [1.5 * act, 3 * act], int(params)))
        c = cluster(*rng.choice([(4, 1), (2, 2)]), intra=1e11, inter=rng.choice([3.125e9, 1e9]), intra_lat=5e-6,
                    inter_lat=3e-5, memory=1.6e10)
        yield Profile("hidden", "synthetic", [4, 8], prof), c, 64, 8
