"""The numpy tables behind the search's bounds (Pruner): the least any split of the rest of the model adds to L."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, cast

import numpy as np

from ...core.schedule import policy_warmup
from .. import tuning

if TYPE_CHECKING:
    from ..model.cost import CostModel

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


def least_work(cm: "CostModel", most: int) -> list[float]:
    """rho[j]: the least per-micro-batch work (ms x devices) any stage split can give layers [0, j) with at most
    ``most`` replicas a stage: per layer the least r (F + B) of a slice on r replicas (the fewest replicas of each
    slice size, :func:`efficient_replicas`: more with the same slice only add work), summed."""
    per = None  # (N,): per layer, the least so far
    for r in efficient_replicas(cm.micro, most):
        f, b, _ = cm.prefix_sums(cm.rows(r))
        work = r * (np.diff(f) + np.diff(b))  # (N,): F + B of each layer on a slice, x r
        per = work if per is None else np.minimum(per, work)
    if per is None:
        raise ValueError(f"least_work: no replica count from 1 to {most} (micro-batch {cm.micro})")
    rho = [0.0]
    for w in per.tolist():
        rho.append(rho[-1] + w)
    return rho


def allreduce_floor(cm: "CostModel", replicas: int, params: np.ndarray) -> np.ndarray:
    """The least ring AllReduce ms of ``params`` bytes (array) over ``replicas`` devices anywhere on the cluster:
    inside one server or across servers, whichever is cheaper (only across when more than a server's worth)."""
    return _ring_floor(_rings(cm, [replicas]), np.asarray([replicas]), params)[0]


def _rings(cm: "CostModel", reps: Sequence[int]) -> list[tuple[np.ndarray, ...]]:
    """Per option of a ring (within a server, across servers): (share, bandwidth, steps, allowed) over ``reps``
    (the cost model's ring; 1 where not allowed: across servers only when more than a server's worth, r = 1 has
    no AllReduce)."""
    cl = cm.cluster
    out: list[tuple[np.ndarray, ...]] = []
    for spans in (False, True):
        rows = []
        for r in reps:
            big = r > cl.devices_per_server
            can = r > 1 and ((big or cl.servers > 1) if spans else not big)
            rows.append(cm.ring_terms(r, spans) + (True,) if can else (1.0, 1.0, 0.0, False))
        share, bw, steps, allowed = (np.array(x) for x in zip(*rows))
        out.append((share, bw, steps, allowed.astype(bool)))
    return out


def _ring_floor(rings: list, reps: np.ndarray, params: np.ndarray) -> np.ndarray:
    """(reps, len(params)): the cheaper allowed ring of ``rings`` (:func:`_rings`) per replica count and size."""
    ar = np.full((len(reps), len(params)), INF)
    for share, bw, steps, allowed in rings:
        t = (share[:, None] * params / bw[:, None] + steps[:, None]) * 1e3
        np.minimum(ar, np.where(allowed[:, None], t, INF), out=ar)
    return np.where((params > 0) & (reps[:, None] > 1), ar, 0.0)


def rest_bound(cm: "CostModel", M: int, devices: int, fill: bool, *, allreduce: bool = False,
               bar: float = INF, overlap: bool = False, chain_allreduce: bool = True) -> np.ndarray:
    """``Q[j, R]``: a lower bound on what layers ``[j, N)`` on at most ``R`` devices add to L, over every split
    into stages of at most ``cm.micro`` replicas, since every stage's own chain is part of L (docs/planner.md,
    "The bounds": the proof, and ``fill``, ``allreduce``, ``overlap``). Stages that do not fit in memory are left
    out, and with ``bar`` those whose own chain reaches it (the bound holds for every plan below ``bar``): M T and,
    with ``chain_allreduce`` (the refined model), its least AllReduce; formula 2 hides the AllReduce of a stage
    after its pivot behind the backwards, so there a stage's own chain is M T alone. Numpy
    over all (c, r, R) at once per j, or per replica count from SearchTuning.row_wise_devices devices on
    (:func:`_rest_row`, faster there).
    """
    N, G = cm.num_layers, devices
    Q = np.full((N + 1, G + 2), INF)  # column G + 1: INF, what a stage of r replicas leaves for R < r
    Q[N, : G + 1] = 0.0
    first = _FirstStages(cm, M, G, bar, overlap, chain_allreduce)
    row_wise = G >= tuning.TUNING.row_wise_devices
    if not row_wise:
        left = np.arange(G + 1)[None, :] - first.r[:, None]  # (reps, G + 1): R - r, the devices left for the rest
        left[left < 0] = G + 1
    for j in range(N - 1, -1, -1):
        T, ok, ar, n = first.every(j, allreduce)  # (reps, N - j): stages [j, c) for c = j+1..N
        if not n:
            continue
        if row_wise:
            _rest_row(Q, j, first, (T, ok, ar), fill, allreduce)
            continue
        T = np.where(ok[:, :n], T[:, :n], INF).T[:, :, None]  # (n, reps, 1): no later end is allowed
        rest = Q[j + 1:j + 1 + n][:, left]  # (n, reps, G + 1): Q[c, R - r]
        # cand[c, r, R] = max(M T (+ AR), offset + Q[c, R - r]), min over (c, r)
        if allreduce:
            own = M * T + cast(np.ndarray, ar)[:, :n].T[:, :, None]  # every() computes it with allreduce
            fpre = first.f2[:, j + 1:j + 1 + n] - first.f2[:, j:j + 1]  # (reps, n): F of every earlier stage
            cand = np.maximum(own, fpre.T[:, :, None] + rest)
        else:
            cand = np.maximum(M * T, T + rest if fill else rest)
        Q[j, : G + 1] = cand.min(axis=(0, 1))
    Q = np.ascontiguousarray(Q[:, : G + 1])
    return Q  # non-increasing in R (Q[N] = 0 lets a split leave devices unused)


def _rest_row(Q: np.ndarray, j: int, first: "_FirstStages", rows: tuple, fill: bool, allreduce: bool) -> None:
    """Row ``Q[j]`` of :func:`rest_bound` one replica count r at a time: Q[c, R - r] for R = r..G is a slice of Q
    (no gather) and r's own allowed ends are all it looks at. The same numbers; faster than all counts at once on
    many devices (every slice size of a large micro-batch is a replica count of its own, most allowed only short
    stages), slower on few (SearchTuning.row_wise_devices)."""
    T, ok, ar = rows  # first.every(j, allreduce)'s
    M = first.M
    G = Q.shape[1] - 2  # (column G + 1: rest_bound's INF column)
    row = Q[j, : G + 1]
    for i, r in enumerate(first.reps):
        m = _span(ok[i])  # ends past j + m are not allowed for r
        if not m:
            continue
        Tr = np.where(ok[i, :m], T[i, :m], INF)[:, None]  # (m, 1)
        rest = Q[j + 1:j + 1 + m, : G + 1 - r]  # (m, G + 1 - r): Q[c, R - r] for R = r..G
        if allreduce:
            fpre = first.f2[i, j + 1:j + 1 + m] - first.f2[i, j]  # (m,): F of the first stage
            cand = np.maximum(M * Tr + ar[i, :m, None], fpre[:, None] + rest)
        else:
            cand = np.maximum(M * Tr, Tr + rest if fill else rest)
        np.minimum(row[r:], cand.min(axis=0), out=row[r:])


def stage_u(M: int, stages: int | None) -> float:
    """The share of min(F, B) in a stage's U = max(F, B) + share x min(F, B) when ``stages`` stages (itself
    included; None: any number) run from it to the last: its warmup K <= 2 stages - 1 (policy B, the larger)
    and M, and its chain and the last stage's ``lead`` give L >= round trip + (M - 1) max + (M - K) min."""
    if M <= 1 or stages is None:
        return 0.0
    k = min(M, policy_warmup("B", stages))
    return (M - k) / (M - 1)


def period_sums(cm: "CostModel", M: int, devices: int, taus: Sequence[float] | np.ndarray, *, bar: float = INF,
                overlap: bool = False, counts: int = 1) -> np.ndarray:
    """``V[k, c, j, R]``: the least sum of T = F + B over the stages of any split of layers ``[j, N)`` into c + 1
    stages (c = counts - 1: at least ``counts``) on at most ``R`` devices whose every stage has U <= ``taus[k]``
    (U = max(F, B) + :func:`stage_u` min(F, B) with the stages from it to the last; stages of at most
    ``cm.micro`` replicas that fit in memory and, with ``bar``, whose M T + least AllReduce is below it, as in
    :func:`rest_bound`; INF where none does). A DP from the last layer backwards over (stage count, j, R),
    V[k, c, j, R] = min over the first stage [j, e) on r replicas of T + V[k, c - 1, e, R - r], over all
    thresholds at once: :func:`period_bound` reads it."""
    N, G, C = cm.num_layers, devices, counts
    K = len(taus)
    # Y[j] = X[:, :, j] (X[:, s]: exactly s stages, s = C: at least C; s = 0 at N only), j first: the ends a
    # first stage may take are then one contiguous block, and the least over them a reduction of its first axis
    Y = np.full((N + 1, K, C + 1, G + 1), INF)
    Y[N, :, 0, :] = 0.0
    first = _FirstStages(cm, M, G, bar, overlap)
    tau = np.asarray(taus, dtype=float)[:, None, None]  # (K, 1, 1)
    share = np.array([stage_u(M, s if s < C else None) for s in range(1, C + 1)])[:, None]  # (C, 1)
    for j in range(N - 1, -1, -1):
        best = Y[j, :, 1:]  # (K, C, G + 1): INF until a first stage [j, e) gives something
        for r in first.reps:
            T, fits, _, n = first(j, r, False)  # stages [j, e) for e = j+1..j+n: no later end is allowed
            if not n:
                continue
            fr, br = first.f2[first.row[r]], first.b2[first.row[r]]
            f, b = fr[j + 1:j + 1 + n] - fr[j], br[j + 1:j + 1 + n] - br[j]  # (n,)
            U = np.maximum(f, b)[None, :] + share * np.minimum(f, b)[None, :]  # (C, n)
            ok = (U[None] <= tau) & fits[None, None, :n]  # (K, C, n)
            Tn = np.where(ok, T[None, None, :n], INF).transpose(2, 0, 1)  # (n, K, C)
            after = Y[j + 1:j + 1 + n, :, :, : G + 1 - r]  # (n, K, C + 1, G + 1 - r): the rest on R - r devices
            # s - 1 stages after it (s = C: C - 1 or at least C): (K, C, G + 1 - r), min over the ends
            cand = (Tn[..., None] + after[:, :, :C]).min(axis=0)
            more = (Tn[:, :, C - 1, None] + after[:, :, C]).min(axis=0)  # (K, G + 1 - r)
            np.minimum(cand[:, C - 1], more, out=cand[:, C - 1])
            np.minimum(best[:, :, r:], cand, out=best[:, :, r:])
    return Y[:, :, 1:].transpose(1, 2, 0, 3)  # (K, C, N + 1, G + 1)


def period_cells(cm: "CostModel", M: int, devices: int, bar: float = INF, overlap: bool = False) -> int:
    """The array elements :func:`period_sums` adds per threshold and stage-count bucket: over every first stage
    [j, e) it may take (as it allows them) on r replicas, G + 1 - r. What its tables cost, before making them."""
    first = _FirstStages(cm, M, devices, bar, overlap)
    return sum(first(j, r, False)[3] * (devices + 1 - r) for j in range(cm.num_layers) for r in first.reps)


def period_bound(cm: "CostModel", M: int, devices: int, lo: float, hi: float, thresholds: int,
                 *, bar: float = INF, overlap: bool = False, counts: int = 1) -> tuple[list, "PeriodRows"]:
    """Tables for a lower bound on L - (one micro-batch's round trip so far) of any split of layers [j, N) into
    c + 1 stages (c = counts - 1: at least counts) on at most R devices after stages whose largest U is t_c
    (refined model, M > 3), since each stage's M backwards and unhidden forwards follow the round trip
    (docs/planner.md, "The bounds"). Over ``thresholds`` thresholds from ``lo`` to ``hi`` (then infinity), a split
    whose largest U lies in (taus[k-1], taus[k]] adds at least V[k][c][j][R] + (M - 1) max(t_c, taus[k-1])
    (:func:`period_sums`), and S[k] = min over k' >= k of V[k'] + (M - 1) taus[k'-1]; returns (taus,
    :class:`PeriodRows` of V and S), read by ``Pruner.period_rest``."""
    taus = np.linspace(lo, hi, thresholds)
    V = period_sums(cm, M, devices, np.concatenate([taus, [INF]]), bar=bar, overlap=overlap,
                    counts=counts)  # (K + 1, C, N + 1, G + 1)
    low = np.concatenate([[0.0], taus]) * (M - 1)  # (K + 1,): each threshold's lower limit x (M - 1)
    S = np.minimum.accumulate((V + low[:, None, None, None])[::-1], axis=0)[::-1]
    S = np.concatenate([S, np.full((1,) + S.shape[1:], INF)])  # S[K + 1]: no threshold above the last
    return taus.tolist(), PeriodRows(V, S)


class PeriodRows:
    """rows[j][R] = [(c, V[:, c, j, R], S[:, c, j, R]) as lists, ...] over the buckets c that some split falls in,
    made on first use (:meth:`row`; the search reads few (j, R))."""

    def __init__(self, V: np.ndarray, S: np.ndarray):
        self.V, self.S = V.transpose(2, 3, 1, 0), S.transpose(2, 3, 1, 0)  # (N + 1, G + 1, C, thresholds)
        self.rows: list = [[None] * V.shape[3] for _ in range(V.shape[2])]

    def row(self, j: int, R: int) -> list:
        S = self.S[j, R]  # (C, K + 2)
        live = np.flatnonzero(S[:, 0] < INF).tolist()
        out = self.rows[j][R] = [(c, v, s) for c, v, s in zip(live, self.V[j, R, live].tolist(), S[live].tolist())]
        return out


class _FirstStages:
    """The candidate first stages [j, c) of the bounds' DPs over the rest of the model, for c = j+1..N, on each
    replica count r of ``reps`` (rows of (reps, N + 1) arrays of prefix sums: F, B, F + B, saved bytes)."""

    def __init__(self, cm: "CostModel", M: int, devices: int, bar: float, overlap: bool = False,
                 chain_allreduce: bool = True):
        self.cm, self.M, self.bar, self.overlap = cm, M, bar, overlap
        self.chain_allreduce = chain_allreduce  # a stage's own chain below the bar counts its AllReduce
        self.reps = efficient_replicas(cm.micro, devices)  # replica counts r <= min(micro, devices)
        self.row = {r: i for i, r in enumerate(self.reps)}
        sums = [cm.prefix_sums(cm.rows(r)) for r in self.reps]
        self.f2, self.b2, self.saved2 = (np.array([x[k] for x in sums]) for k in range(3))
        self.fb2 = self.f2 + self.b2
        self.params = np.asarray(cm.param_prefix)
        self.static = np.outer([cm.static_factor(r) for r in self.reps], self.params)  # (reps, N + 1)
        self.r = np.asarray(self.reps)
        self.rings = _rings(cm, self.reps)
        self.last: tuple = (None, None)  # ((j, allreduce), every(j, allreduce)): what __call__ reads rows of

    def __call__(self, j: int, r: int, allreduce: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
        """(T = F + B of each, which a bound may use, what their AllReduce adds to their chain at least (its
        floor; overlapped: the floor - B, at least 0) (with ``allreduce`` or a bar, else None), n: ends past
        j + n are never allowed). Allowed: fits in device memory (parameters x optimizer factor + one saved
        slice) and, below the bar, its own chain M T + that AllReduce term stays below it. Row r of
        :meth:`every` (kept for the next r of the same j)."""
        if self.last[0] != (j, allreduce):
            self.last = ((j, allreduce), self.every(j, allreduce))
        T, ok, ar, _ = self.last[1]
        i = self.row[r]
        return T[i], ok[i], ar[i] if ar is not None else None, _span(ok[i])

    def every(self, j: int, allreduce: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
        """:meth:`__call__` for every r at once: (T, ok, AR term) as (reps, N - j) arrays, n: the largest span."""
        T = self.fb2[:, j + 1:] - self.fb2[:, j:j + 1]  # (reps, N - j)
        ar = None
        if allreduce or (self.bar < INF and self.chain_allreduce):
            ar = _ring_floor(self.rings, self.r, self.params[j + 1:] - self.params[j])
            if self.overlap:  # E - B >= AR - B: the part of the AllReduce after the last backward
                ar = np.maximum(ar - (self.b2[:, j + 1:] - self.b2[:, j:j + 1]), 0.0)
        ok = (self.static[:, j + 1:] - self.static[:, j:j + 1]) + (self.saved2[:, j + 1:] - self.saved2[:, j:j + 1]) \
            <= self.cm.cluster.device_memory
        if self.bar < INF:
            ok &= self.M * T + ar < self.bar if ar is not None else self.M * T < self.bar
        cols = np.flatnonzero(ok.any(axis=0))
        return T, ok, ar, int(cols[-1]) + 1 if len(cols) else 0


def _span(ok: np.ndarray) -> int:
    """1 + the index of the last True in ``ok`` (0 if none): the ends beyond it need not be looked at."""
    idx = np.flatnonzero(ok)
    return int(idx[-1]) + 1 if len(idx) else 0
