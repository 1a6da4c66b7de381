"""Pipeline latency of one iteration: paper formula 2 with the pivot stage of Algorithm 1 (formula 3)."""

from __future__ import annotations

from typing import NamedTuple, Sequence


class Latency(NamedTuple):
    """L = Tw + Ts + Te in ms; ``pivot`` indexes the interleaved stage list (compute 2i, communication 2i+1)."""

    warmup: float
    steady: float
    ending: float
    pivot: int

    @property
    def total(self) -> float:
        return self.warmup + self.steady + self.ending


def pivot_stage(F: Sequence[float], B: Sequence[float], M: int) -> int:
    """Algorithm 1 / formula 3: Q = S-1; for s = S-2..0, Q = s if (M-1)(F_s+B_s) > (M-1)(F_Q+B_Q) + sum_{s<s'<Q}."""
    q = len(F) - 1
    between = 0.0  # sum_{s < s' < Q} (F_s' + B_s')
    for s in range(len(F) - 2, -1, -1):
        if (M - 1) * (F[s] + B[s]) > (M - 1) * (F[q] + B[q]) + between:
            q, between = s, 0.0
        else:
            between += F[s] + B[s]
    return q


def paper_latency(F: Sequence[float], B: Sequence[float], AR: Sequence[float], M: int) -> Latency:
    """Formula 2 (conference version of Te, see docs/design.md) over all stages, communication stages included.

    Tw = sum_{s<=Q} F_s; Ts = (M-1)(F_Q+B_Q);
    Te = max_s AR_s + (sum_{a=s..Q} B_a if s <= Q else -sum_{a=Q..s} B_a).
    """
    q = pivot_stage(F, B, M)
    tw = sum(F[: q + 1])
    ts = (M - 1) * (F[q] + B[q])
    te = float("-inf")
    acc = 0.0
    for s in range(q, -1, -1):  # s <= Q: AR_s + sum_{a=s..Q} B_a
        acc += B[s]
        te = max(te, AR[s] + acc)
    acc = B[q]
    for s in range(q + 1, len(F)):  # s > Q: AR_s - sum_{a=Q..s} B_a
        acc += B[s]
        te = max(te, AR[s] - acc)
    return Latency(tw, ts, te, q)
