"""Formula 2 with the pivot of Algorithm 1 on hand-computed pipelines; properties the DP's bounds rely on."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapple.planner.model.pivot import paper_latency, pivot_stage
from dapple.planner.model.refined import refined_chains, refined_latency


def test_two_stages_pivot_last():
    # interleaved: stage 0, communication, stage 1
    lat = paper_latency(F=[2, 1, 3], B=[4, 1, 6], AR=[5, 0, 1], M=4)
    # Q = 2 (stage 1): (M-1)(F+B) = 18 for stage 0 does not beat 27 + 2 of the communication stage
    assert lat.pivot == 2
    assert lat.warmup == 6  # F0 + F_comm + F1
    assert lat.steady == 27  # (M-1)(F1 + B1)
    assert lat.ending == 16  # max(AR1 + B1, B1 + B_comm, AR0 + B1 + B_comm + B0) = AR0 + 11
    assert lat.total == 49


def test_two_stages_pivot_first():
    lat = paper_latency(F=[10, 1, 2], B=[20, 1, 4], AR=[3, 0, 8], M=5)
    assert lat.pivot == 0  # 4 * 30 > 4 * 6 + 2
    assert (lat.warmup, lat.steady, lat.ending) == (10, 120, 23)  # Te: AR0 + B0; later stages subtract


def test_three_stages_pivot_in_the_middle():
    F = [1, 0.5, 4, 0.5, 1]
    B = [2, 0.5, 8, 0.5, 2]
    AR = [0, 0, 10, 0, 1]
    assert pivot_stage(F, B, 3) == 2
    lat = paper_latency(F, B, AR, M=3)
    assert lat.warmup == pytest.approx(5.5)
    assert lat.steady == pytest.approx(24)
    assert lat.ending == pytest.approx(18)  # AR_Q + B_Q: the conference Te counts B_Q once (docs/design.md erratum)
    assert lat.total == pytest.approx(47.5)


def test_equal_stages_without_communication_fill_and_drain():
    S, M = 3, 4
    lat = paper_latency([1, 0, 1, 0, 1], [2, 0, 2, 0, 2], [0] * 5, M)
    assert lat.total == (M + S - 1) * 3
    K = [3, 2, 1]
    assert refined_latency([1, 0, 1, 0, 1], [2, 0, 2, 0, 2], [0] * 5, None, K, M).total == (M + S - 1) * 3


def test_formula_2_is_not_monotone_in_stage_costs():
    """A slower communication stage becomes the pivot and hides stage 1's AllReduce behind negative terms:
    why the DP cannot be exact under formula 2 (found by the brute force, see test_search)."""
    fast = paper_latency([0.5, 0.9, 1], [0.5, 0.9, 1], [0, 0, 100], 10)
    slow = paper_latency([0.5, 1.1, 1], [0.5, 1.1, 1], [0, 0, 100], 10)
    assert (fast.pivot, slow.pivot) == (2, 1)
    assert slow.total < fast.total
    ok_fast = refined_latency([0.5, 0.9, 1], [0.5, 0.9, 1], [0, 0, 100], None, [2, 1], 10)
    ok_slow = refined_latency([0.5, 1.1, 1], [0.5, 1.1, 1], [0, 0, 100], None, [2, 1], 10)
    assert ok_slow.total >= ok_fast.total  # the refined model has no such inversion here


def test_refined_single_micro_batch_is_one_round_trip():
    lat = refined_latency([1, 0.5, 2], [2, 0.5, 4], [3, 0, 0], None, [2, 1], 1)
    assert lat.total == pytest.approx(1 + 0.5 + 2 + 4 + 0.5 + 2 + 3)


def test_refined_window_bubbles():
    # stage 0 holds K_0 micro-batches; its round trip through slow links is 2 + 10 + 2 + 4 + 10 + 2 = 30
    F, B, AR = [1, 10, 2], [2, 10, 4], [0, 0, 0]
    a = refined_latency(F, B, AR, None, [2, 1], 20).total  # policy A: K_0 = 2 -> 15 per micro-batch
    b = refined_latency(F, B, AR, None, [3, 1], 20).total  # policy B: K_0 = 3 -> 10 per micro-batch
    assert b < a
    assert a >= 19 * 15


stage_costs = st.lists(st.tuples(st.floats(0, 10), st.floats(0, 10), st.floats(0, 50)), min_size=1, max_size=5)


@settings(max_examples=200, deadline=None)
@given(compute=stage_costs, comm=st.lists(st.floats(0, 5), min_size=4, max_size=4), M=st.integers(1, 40))
def test_latency_is_at_least_M_times_any_stage(compute, comm, M):
    """L >= M (F_s + B_s) for every stage: the DP prunes with this bound, so it must hold for both models."""
    F, B, AR = [], [], []
    for i, (f, b, ar) in enumerate(compute):
        if i:
            F.append(comm[i - 1])
            B.append(comm[i - 1])
            AR.append(0.0)
        F.append(f)
        B.append(b)
        AR.append(ar)
    bound = M * max(f + b for f, b in zip(F, B))
    assert paper_latency(F, B, AR, M).total >= bound - 1e-9
    n = len(compute)
    K = [max(1, n - i) for i in range(n)]
    assert refined_latency(F, B, AR, None, K, M).total >= M * max(F[a] + B[a] for a in range(0, len(F), 2)) - 1e-9
    assert refined_latency(F, B, AR, None, K, M).total >= sum(F) + sum(B) - 1e-9  # one micro-batch's round trip


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.randoms(use_true_random=False), st.floats(0.3, 1.5))
def test_refined_chains_stop_at_the_limit_without_changing_what_is_below_it(stages, M, rnd, scale):
    """refined_chains(limit=x): below x the value (and pivot) is the unlimited one; at or above x, so is that."""
    S = 2 * stages - 1
    F = [rnd.uniform(0.0, 5.0) for _ in range(S)]
    B = [x * rnd.uniform(1.0, 2.5) for x in F]
    AR = [rnd.uniform(0.0, 8.0) if a % 2 == 0 else 0.0 for a in range(S)]
    C = [b if a % 2 == 0 else b * rnd.uniform(0.2, 1.0) for a, b in enumerate(B)]
    Ks = [[max(1, stages - i) for i in range(stages)], [max(1, 2 * (stages - i) - 1) for i in range(stages)]]
    period = rnd.uniform(0.0, 6.0)
    full = refined_chains(F, B, AR, None, Ks, M, link_period=period, chain=C)
    limit = max(t for t, _ in full) * scale
    limited = refined_chains(F, B, AR, None, Ks, M, link_period=period, chain=C, limit=limit)
    for (t_lim, parts_lim), (t, parts) in zip(limited, full):
        if t_lim < limit:
            assert (t_lim, parts_lim) == (t, parts)
        else:
            assert t >= limit and t_lim <= t


def test_a_transfer_queues_at_the_link_period():
    """A communication stage's M transfers go no faster than once per link period (its link carries other
    stages' transfers too), also with fewer micro-batches than the upstream warmup, where the arrivals follow
    the slowest forward: each of the M - 1 later transfers waits the extra (period - own time)."""
    F, B, AR = [1.0, 10.0, 1.0], [2.0, 10.0, 2.0], [0.0] * 3
    alone = refined_chains(F, B, AR, None, [[2, 1]], 2, link_period=10.0)[0].total
    shared = refined_chains(F, B, AR, None, [[2, 1]], 2, link_period=30.0)[0].total
    assert shared >= alone + (2 - 1) * (30.0 - 10.0) - 1e-9
