"""Lower bounds on the latency any completion of a DP prefix can reach: min-max and period bounds of the rest."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

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


def allreduce_floor(cm: "CostModel", replicas: int, params: np.ndarray) -> np.ndarray:
    """The least ring AllReduce ms of ``params`` bytes (array) over ``replicas`` devices anywhere on the cluster:
    inside one server or across servers, whichever is cheaper (only across when more than a server's worth)."""
    cl = cm.cluster
    if replicas <= 1:
        return np.zeros_like(params)
    where = (True,) if replicas > cl.devices_per_server else ((False, True) if cl.servers > 1 else (False,))
    best = None
    for spans in where:
        share, bw, steps = cm._ring(replicas, spans)  # the cost model's ring, over a whole array of sizes
        t = (share * params / bw + steps) * 1e3
        best = t if best is None else np.minimum(best, t)
    return np.where(params > 0, best, 0.0)


def rest_bound(cm: "CostModel", M: int, devices: int, fill: bool, allreduce: bool = False,
               cut: float = INF, overlap: bool = False) -> np.ndarray:
    """``Q[j, R]``: a lower bound on what layers ``[j, N)`` on at most ``R`` devices add to L, over every
    split into stages of at most ``cm.micro`` replicas (a stage of r replicas takes T = F + B of its slice of
    ceil(micro / r) rows, communication taken as 0).

    Both latency models satisfy L >= M (F_s + B_s) for every stage s; the refined model also L >= (the
    first micro-batch's forwards before s) + M (F_s + B_s) + max(the last gradient's backwards before s,
    AR_s) (``refined.refined_chains``: a stage's chain ends with the longer of its AllReduce and the way
    down). Without ``allreduce`` the bound takes the backwards (``fill``: T of every earlier stage, AllReduce
    0); with it the AllReduce (at least :func:`allreduce_floor`; F of every earlier stage, no backwards):
    two valid bounds, whose larger one the search uses. ``overlap`` (the AllReduce overlaps the last
    backward): a stage's chain ends E_s - B_s after its last backward, and E_s >= AR_s
    (``CostModel.overlapped_ending``), so max(AR_s - B_s, 0) takes AR_s's place. The min over splits of the
    max over stages is a DP from the last layer backwards: Q[j, R] = min over the first stage [j, c) on r
    replicas of max(M T + AR, offset + Q[c, R - r]), Q[N, .] = 0. Stages whose parameters x optimizer factor
    + one saved slice exceed device memory are excluded, and with ``cut`` (refined model) stages
    whose M T + least AllReduce reaches it (their own chain does: the bound then holds for every plan below
    ``cut``). Computed with numpy over all (c, R) at once per (j, r): about N x sqrt(micro) vector operations.
    """
    N, G = cm.num_layers, devices
    Q = np.full((N + 1, G + 1), INF)
    Q[N, :] = 0.0
    first = _FirstStages(cm, M, G, cut, overlap)
    for j in range(N - 1, -1, -1):
        best = np.full(G + 1, INF)
        for r in first.reps:
            T, ok, ar, n = first(j, r, allreduce)
            if not n:
                continue
            T = np.where(ok[:n], T[:n], INF)  # stages [j, c) for c = j+1..j+n: no later end is allowed
            # cand[c, R] = max(M T_c (+ AR_c), offset_c + Q[c, R - r]) for R = r..G
            rest = Q[j + 1:j + 1 + n, : G + 1 - r]
            if allreduce:
                own, fpre = M * T + ar[:n], first.f[r]
                cand = np.maximum(own[:, None], (fpre[j + 1:j + 1 + n] - fpre[j])[:, None] + rest)
            else:
                cand = np.maximum(M * T[:, None], T[:, None] + rest if fill else rest)
            np.minimum(best[r:], cand.min(axis=0), out=best[r:])
        Q[j] = best
    return Q  # non-increasing in R (Q[N] = 0 lets a split leave devices unused)


def period_sums(cm: "CostModel", M: int, devices: int, taus: Sequence[float], cut: float = INF,
                overlap: bool = False) -> np.ndarray:
    """``V[k, j, R]``: the least sum of T = F + B over the stages of any split of layers ``[j, N)`` on at most
    ``R`` devices whose every stage has T <= ``taus[k]`` (stages of at most ``cm.micro`` replicas that fit in
    memory and, with ``cut``, whose M T + least AllReduce is below it, as in :func:`rest_bound`; INF where
    none does). A DP from the last layer backwards, V[k, j, R] = min over the first stage [j, c) on r
    replicas of T + V[k, c, R - r], over all thresholds at once: :func:`period_bound` reads it."""
    N, G = cm.num_layers, devices
    K = len(taus)
    V = np.full((K, N + 1, G + 1), INF)
    V[:, N, :] = 0.0
    first = _FirstStages(cm, M, G, cut, overlap)
    tau = np.asarray(taus, dtype=float)[:, None]  # (K, 1)
    for j in range(N - 1, -1, -1):
        best = np.full((K, G + 1), INF)
        for r in first.reps:
            T, fits, _, n = first(j, r, False)  # stages [j, c) for c = j+1..j+n: no later end is allowed
            if not n:
                continue
            ok = (T[None, :n] <= tau) & fits[None, :n]  # (K, n)
            Tk = np.where(ok, T[None, :n], INF)  # (K, n)
            cand = Tk[:, :, None] + V[:, j + 1:j + 1 + n, : G + 1 - r]  # (K, n, G + 1 - r)
            np.minimum(best[:, r:], cand.min(axis=1), out=best[:, r:])
        V[:, j] = best
    return V


def period_bound(cm: "CostModel", M: int, devices: int, lo: float, hi: float, thresholds: int,
                 cut: float = INF, overlap: bool = False) -> tuple[list, list, list]:
    """Tables for a lower bound on L - (one micro-batch's round trip so far) of any split of layers [j, N) on
    at most R devices that follows stages whose period is t (refined model, M > 3).

    The last stage's chain in ``refined.refined_chains`` is at least the round trip of one micro-batch
    (every stage's and transfer's F on the way up and B on the way down) plus (M - 3) periods: after its
    upstream stage's K <= 3 warmup forwards, the forwards arrive once per period P, and P >= the largest
    F + B of any stage. So L >= (round trip so far) + sum over the rest's stages of T + (M - 3) max(t, max T).
    Over thresholds ``taus`` (``thresholds`` of them from ``lo`` to ``hi``, then infinity) a split whose
    largest T lies in (taus[k-1], taus[k]] adds at least V[k][j][R] + (M - 3) max(t, taus[k-1])
    (:func:`period_sums`); returns (taus, V, S) with S[k] = min over k' >= k of V[k'] + (M - 3) taus[k'-1]
    (taus[-1] = 0), read by ``_DP.period_rest``."""
    taus = np.linspace(lo, hi, thresholds)
    V = period_sums(cm, M, devices, np.concatenate([taus, [INF]]), cut, overlap)  # (K + 1, N + 1, G + 1)
    low = np.concatenate([[0.0], taus]) * (M - 3)  # (K + 1,): each threshold's lower limit x (M - 3)
    S = np.minimum.accumulate((V + low[:, None, None])[::-1], axis=0)[::-1]
    S = np.concatenate([S, np.full((1,) + S.shape[1:], INF)])  # S[K + 1]: no threshold above the last
    return taus.tolist(), V.tolist(), S.tolist()


class _FirstStages:
    """The candidate first stages [j, c) of the bounds' DPs over the rest of the model, for c = j+1..N."""

    def __init__(self, cm: "CostModel", M: int, devices: int, cut: float, overlap: bool = False):
        self.cm, self.M, self.cut, self.overlap = cm, M, cut, overlap
        self.reps = efficient_replicas(cm.micro, devices)  # replica counts r <= min(micro, devices)
        self.fb, self.f, self.b, self.saved = {}, {}, {}, {}  # per r: prefix sums of F + B, F, B, saved bytes
        for r in self.reps:
            f, bk, sv = cm._sums(cm.rows(r))
            self.fb[r], self.f[r], self.b[r] = np.asarray(f) + np.asarray(bk), np.asarray(f), np.asarray(bk)
            self.saved[r] = np.asarray(sv)
        self.params = np.asarray(cm._pre_params)
        self.static = self.params * cm.optimizer_factor

    def __call__(self, j: int, r: int, allreduce: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
        """(T = F + B of each, which a bound may use, what their AllReduce adds to their chain at least (its
        floor; overlapped: the floor - B, at least 0) (with ``allreduce`` or a cut, else None), n: ends past
        j + n are never allowed). Allowed: fits in device memory (parameters x optimizer factor + one saved
        slice) and, below the cut, its own chain M T + that AllReduce term stays below it."""
        pre, sv, params, static = self.fb[r], self.saved[r], self.params, self.static
        T = pre[j + 1:] - pre[j]  # (N - j,)
        ar = allreduce_floor(self.cm, r, params[j + 1:] - params[j]) if allreduce or self.cut < INF else None
        if ar is not None and self.overlap:  # E - B >= AR - B: the part of the AllReduce after the last backward
            ar = np.maximum(ar - (self.b[r][j + 1:] - self.b[r][j]), 0.0)
        ok = (static[j + 1:] - static[j]) + (sv[j + 1:] - sv[j]) <= self.cm.cluster.device_memory
        if self.cut < INF:
            ok &= self.M * T + ar < self.cut
        return T, ok, ar, _span(ok)


def _span(ok: np.ndarray) -> int:
    """1 + the index of the last True in ``ok`` (0 if none): the ends beyond it need not be looked at."""
    idx = np.flatnonzero(ok)
    return int(idx[-1]) + 1 if len(idx) else 0
