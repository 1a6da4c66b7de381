"""Small synthetic profiles and clusters for planner tests (pure Python, no torch)."""

from __future__ import annotations

import random
from typing import Sequence

from dapple import Cluster, Profile
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
