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


def rest_bound(cm: "CostModel", M: int, devices: int, fill: bool, check_memory: bool = True,
               allreduce: bool = False, cut: float = INF) -> np.ndarray:
    """``Q[j, R]``: a lower bound on what layers ``[j, N)`` on at most ``R`` devices add to L, over every
    split into stages of at most ``cm.micro`` replicas (a stage of r replicas takes T = F + B of its slice of
    ceil(micro / r) rows, communication taken as 0).

    Both latency models satisfy L >= M (F_s + B_s) for every stage s; the refined model also L >= (the
    first micro-batch's forwards before s) + M (F_s + B_s) + max(the last gradient's backwards before s,
    AR_s) (``refined.refined_chains``: a stage's chain ends with the longer of its AllReduce and the way
    down). Without ``allreduce`` the bound takes the backwards (``fill``: T of every earlier stage, AllReduce
    0); with it the AllReduce (at least :func:`allreduce_floor`; F of every earlier stage, no backwards):
    two valid bounds, whose larger one the search uses. The min over splits of the max over stages is a DP
    from the last layer backwards: Q[j, R] = min over the first stage [j, c) on r replicas of
    max(M T + AR, offset + Q[c, R - r]), Q[N, .] = 0. Stages whose parameters x optimizer factor + one
    saved slice exceed device memory are excluded, and with ``cut`` (refined model without overlap) stages
    whose M T + least AllReduce reaches it (their own chain does: the bound then holds for every plan below
    ``cut``). Computed with numpy over all (c, R) at once per (j, r): about N x sqrt(micro) vector operations.
    """
    N, b = cm.num_layers, cm.micro
    G = devices
    Q = np.full((N + 1, G + 1), INF)
    Q[N, :] = 0.0
    reps = efficient_replicas(b, G)
    fb = {}  # prefix sums of F + B and of F per slice size; memory: static and saved bytes prefix sums
    for r in reps:
        rows = cm.rows(r)
        f, bk, sv = cm._sums(rows)
        fb[r] = (np.asarray(f) + np.asarray(bk), np.asarray(f), np.asarray(sv))
    params = np.asarray(cm._pre_params)
    static = params * cm.optimizer_factor
    mem = cm.cluster.device_memory
    for j in range(N - 1, -1, -1):
        best = np.full(G + 1, INF)
        for r in reps:
            if r > G:
                break
            pre, fpre, sv = fb[r]
            T = pre[j + 1:] - pre[j]  # (N - j,): F + B of [j, c) for c = j+1..N
            ar = allreduce_floor(cm, r, params[j + 1:] - params[j]) if allreduce or cut < INF else None
            ok = _allowed(M, T, ar, cut, (static[j + 1:] - static[j]) + (sv[j + 1:] - sv[j]) if check_memory
                          else None, mem)
            n = len(T)
            if ok is not None:
                n = _span(ok)
                if not n:
                    continue
                T = np.where(ok[:n], T[:n], INF)  # stages [j, c) for c = j+1..j+n: no later end is allowed
            # cand[c, R] = max(M T_c (+ AR_c), offset_c + Q[c, R - r]) for R = r..G
            rest = Q[j + 1:j + 1 + n, : G + 1 - r]
            if allreduce:
                own = M * T + ar[:n]
                cand = np.maximum(own[:, None], (fpre[j + 1:j + 1 + n] - fpre[j])[:, None] + rest)
            else:
                cand = np.maximum(M * T[:, None], T[:, None] + rest if fill else rest)
            np.minimum(best[r:], cand.min(axis=0), out=best[r:])
        Q[j] = best
    return Q  # non-increasing in R (Q[N] = 0 lets a split leave devices unused)


def period_sums(cm: "CostModel", M: int, devices: int, taus: Sequence[float], cut: float = INF) -> np.ndarray:
    """``V[k, j, R]``: the least sum of T = F + B over the stages of any split of layers ``[j, N)`` on at most
    ``R`` devices whose every stage has T <= ``taus[k]`` (stages of at most ``cm.micro`` replicas that fit in
    memory and, with ``cut``, whose M T + least AllReduce is below it, as in :func:`rest_bound`; INF where
    none does). A DP from the last layer backwards, V[k, j, R] = min over the first stage [j, c) on r
    replicas of T + V[k, c, R - r], over all thresholds at once: :func:`period_bound` reads it."""
    N, b, G = cm.num_layers, cm.micro, devices
    K = len(taus)
    V = np.full((K, N + 1, G + 1), INF)
    V[:, N, :] = 0.0
    reps = efficient_replicas(b, G)
    params = np.asarray(cm._pre_params)
    static = params * cm.optimizer_factor
    mem = cm.cluster.device_memory
    sums = {}
    for r in reps:
        f, bk, sv = cm._sums(cm.rows(r))
        sums[r] = (np.asarray(f) + np.asarray(bk), np.asarray(sv))
    tau = np.asarray(taus, dtype=float)[:, None]  # (K, 1)
    for j in range(N - 1, -1, -1):
        best = np.full((K, G + 1), INF)
        for r in reps:
            pre, sv = sums[r]
            T = pre[j + 1:] - pre[j]  # (N - j,): T of [j, c) for c = j+1..N
            ar = allreduce_floor(cm, r, params[j + 1:] - params[j]) if cut < INF else None
            fits = _allowed(M, T, ar, cut, (static[j + 1:] - static[j]) + (sv[j + 1:] - sv[j]), mem)
            n = _span(fits)  # stages [j, c) for c = j+1..j+n: no later end is allowed
            if not n:
                continue
            ok = (T[None, :n] <= tau) & fits[None, :n]  # (K, n)
            Tk = np.where(ok, T[None, :n], INF)  # (K, n)
            cand = Tk[:, :, None] + V[:, j + 1:j + 1 + n, : G + 1 - r]  # (K, n, G + 1 - r)
            np.minimum(best[:, r:], cand.min(axis=1), out=best[:, r:])
        V[:, j] = best
    return V


def period_bound(cm: "CostModel", M: int, devices: int, lo: float, hi: float, thresholds: int,
                 cut: float = INF) -> tuple[list, list, list]:
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
    V = period_sums(cm, M, devices, np.concatenate([taus, [INF]]), cut)  # (K + 1, N + 1, G + 1)
    low = np.concatenate([[0.0], taus]) * (M - 3)  # (K + 1,): each threshold's lower limit x (M - 3)
    S = np.minimum.accumulate((V + low[:, None, None])[::-1], axis=0)[::-1]
    S = np.concatenate([S, np.full((1,) + S.shape[1:], INF)])  # S[K + 1]: no threshold above the last
    return taus.tolist(), V.tolist(), S.tolist()


def _allowed(M: int, T: np.ndarray, ar: np.ndarray | None, cut: float, nbytes: np.ndarray | None,
             mem: float) -> np.ndarray | None:
    """Which stages a bound may use: those that fit in memory (``nbytes``: static + one saved slice, None:
    unchecked) and, below ``cut``, whose own chain M T + AllReduce floor ``ar`` stays below it (None: all)."""
    ok = None if nbytes is None else nbytes <= mem
    if cut < INF:
        own = M * T + ar < cut
        ok = own if ok is None else ok & own
    return ok


def _span(ok: np.ndarray) -> int:
    """1 + the index of the last True in ``ok`` (0 if none): the ends beyond it need not be looked at."""
    idx = np.flatnonzero(ok)
    return int(idx[-1]) + 1 if len(idx) else 0
