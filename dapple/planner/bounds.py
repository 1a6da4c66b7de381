"""Lower bounds on the latency any completion of a DP prefix can reach: a min-max stage split of the rest."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .cost import CostModel

INF = float("inf")


def efficient_replicas(micro: int, most: int) -> list[int]:
    """Replica counts r <= ``most`` that are the fewest giving their slice size ceil(micro / r): a stage on
    more replicas with the same slice size is no faster, so only these matter to a bound."""
    out, seen = [], set()
    for r in range(1, min(micro, most) + 1):
        rows = -(-micro // r)
        if rows not in seen:
            seen.add(rows)
            out.append(r)
    return out


def rest_bound(cm: "CostModel", M: int, devices: int, fill: bool, check_memory: bool = True) -> np.ndarray:
    """``Q[j, R]``: a lower bound on what layers ``[j, N)`` on at most ``R`` devices add to L, over every
    split into stages of at most ``cm.micro`` replicas (a stage of r replicas takes T = F + B of its slice of
    ceil(micro / r) rows, communication and AllReduce taken as 0).

    Both latency models satisfy L >= M (F_s + B_s) for every stage s; the refined model also L >= (the
    first micro-batch's forwards before s) + M (F_s + B_s) + (the last gradient's backwards before s)
    (``fill``). The min over splits of the max over stages is a DP from the last layer backwards:
    Q[j, R] = min over the first stage [j, c) on r replicas of max(M T, fill T + Q[c, R - r]), Q[N, .] = 0.
    Stages whose parameters x optimizer factor + one saved slice exceed device memory are excluded.
    Computed with numpy over all (c, R) at once per (j, r): about N x sqrt(micro) vector operations.
    """
    N, b = cm.num_layers, cm.micro
    G = devices
    Q = np.full((N + 1, G + 1), INF)
    Q[N, :] = 0.0
    reps = efficient_replicas(b, G)
    fb = {}  # prefix sums of F + B per slice size; memory: static and saved bytes prefix sums
    for r in reps:
        rows = cm.rows(r)
        f, bk, sv = cm._sums(rows)
        fb[r] = (np.asarray(f) + np.asarray(bk), np.asarray(sv))
    static = np.asarray(cm._pre_params) * cm.optimizer_factor
    mem = cm.cluster.device_memory
    for j in range(N - 1, -1, -1):
        best = np.full(G + 1, INF)
        for r in reps:
            if r > G:
                break
            pre, sv = fb[r]
            T = pre[j + 1:] - pre[j]  # (N - j,): F + B of [j, c) for c = j+1..N
            if check_memory:
                ok = (static[j + 1:] - static[j]) + (sv[j + 1:] - sv[j]) <= mem
                if not ok.any():
                    continue
                T = np.where(ok, T, INF)
            # cand[c, R] = max(M T_c, fill T_c + Q[c, R - r]) for R = r..G
            rest = Q[j + 1:, : G + 1 - r]
            cand = np.maximum(M * T[:, None], T[:, None] + rest if fill else rest)
            np.minimum(best[r:], cand.min(axis=0), out=best[r:])
        Q[j] = best
    return Q  # non-increasing in R (Q[N] = 0 lets a split leave devices unused)


def bound_split(cm: "CostModel", M: int, devices: int, fill: bool, Q: np.ndarray) -> list[tuple[int, int, int]]:
    """The split that attains ``Q[0, devices]``: [(layer_start, layer_end, replicas), ...], which may leave
    devices unused; a good first plan for the search once placed (communication and AllReduce ignored)."""
    N, b = cm.num_layers, cm.micro
    out, j, R = [], 0, devices
    while j < N:
        target, pick = Q[j, R], None
        for r in efficient_replicas(b, R):
            f, bk, _ = cm._sums(cm.rows(r))
            for c in range(j + 1, N + 1):
                T = f[c] - f[j] + bk[c] - bk[j]
                v = max(M * T, (T if fill else 0.0) + Q[c, R - r])
                if v <= target * (1 + 1e-12) and (pick is None or v < pick[0]):
                    pick = (v, c, r)
        if pick is None:
            return []
        out.append((j, pick[1], pick[2]))
        j, R = pick[1], R - pick[2]
    return out
