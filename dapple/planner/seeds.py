"""Seed plans for the DP's bound: S stages of about G/S replicas on consecutive devices, cut to balance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

from .cost import Layout

if TYPE_CHECKING:
    from .cost import CostModel


def consecutive_layouts(reps: Sequence[int], per_server: int) -> list[Layout]:
    """Stages taking consecutive device ids (0, 1, ...), as server layouts."""
    lays, d = [], 0
    for r in reps:
        lays.append(tuple((d + k) // per_server for k in range(r)))
        d += r
    return lays


def work_cuts(rho: Sequence[float], reps: Sequence[int]) -> list[int]:
    """Cuts giving each stage a share of the least work ``rho`` (prefix sums per layer) proportional to its
    replicas."""
    N, G, S = len(rho) - 1, sum(reps), len(reps)
    cuts, a = [], 0
    for i in range(S - 1):
        target = rho[N] * sum(reps[: i + 1]) / G
        c = a + 1
        while c < N - (S - 1 - i) and rho[c] < target:
            c += 1
        cuts.append(c)
        a = c
    return cuts


def balanced_cuts(cm: "CostModel", reps: Sequence[int]) -> list[int] | None:
    """Cuts minimising the slowest stage's F + B on its slice (min-max partition for fixed replica counts):
    bisection on the period P, each stage greedily taking layers while it stays within P."""
    N, S = cm.num_layers, len(reps)
    sums = []
    for r in reps:
        f, b, _ = cm._sums(cm.rows(r))
        sums.append([x + y for x, y in zip(f, b)])

    def cover(P: float) -> list[int] | None:
        cuts, a = [], 0
        for i in range(S - 1):
            pre, c = sums[i], a + 1
            if pre[c] - pre[a] > P:
                return None
            while c < N - (S - 1 - i) and pre[c + 1] - pre[a] <= P:
                c += 1
            cuts.append(c)
            a = c
        return cuts if sums[-1][N] - sums[-1][a] <= P else None

    lo, hi = 0.0, max(s[N] for s in sums)
    best = cover(hi)
    if best is None:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        got = cover(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return best


def even_seeds(cm: "CostModel", rho: Sequence[float], devices: int, per_server: int,
               max_stages: int | None = None) -> Iterator[tuple]:
    """For every stage count S: G/S replicas per stage (the first G mod S one more) on consecutive devices,
    cut by work share and by balanced stage time; yields spans ((a, c, layout), ...)."""
    N, G, b = cm.num_layers, devices, cm.micro
    for S in range(1, min(N, G, N if max_stages is None else max_stages) + 1):
        reps = [G // S + (1 if i < G % S else 0) for i in range(S)]
        if max(reps) > b:
            continue
        lays = consecutive_layouts(reps, per_server)
        seen = set()
        for cuts in (work_cuts(rho, reps), balanced_cuts(cm, reps)):
            if cuts is None or tuple(cuts) in seen:
                continue
            seen.add(tuple(cuts))
            bounds = [0] + list(cuts) + [N]
            yield tuple((bounds[i], bounds[i + 1], lays[i]) for i in range(S))
