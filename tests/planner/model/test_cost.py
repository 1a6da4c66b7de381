"""Cost model: slice compute on the slowest replica, split-concat transfers over shared links, ring AllReduce."""

from __future__ import annotations

import pytest

from dapple.planner.model.cost import CostModel

from ..helpers import cluster, linear_profile


def test_stage_time_is_the_slowest_replicas_slice():
    cm = CostModel(linear_profile([1.0, 2.0, 3.0]), cluster(1, 4), micro_batch_size=8)
    assert cm.compute(0, 3, 1) == pytest.approx((6.0 * 8, 12.0 * 8))
    assert cm.rows(3) == 3  # 8 rows over 3 replicas: 3, 3, 2
    assert cm.compute(1, 3, 3) == pytest.approx((5.0 * 3, 10.0 * 3))
    assert cm.compute(0, 1, 8) == pytest.approx((1.0, 2.0))


def test_transfers_share_links():
    # 1e6 bytes per row, micro-batch 8: a whole micro-batch is 8e6 bytes; 1e10 B/s inside, 1e9 between servers
    cm = CostModel(linear_profile([1.0] * 3, boundary=1e6), cluster(2, 2), micro_batch_size=8)
    assert cm.comm(0, (0,), (0,)) == pytest.approx((0.8, 0.8))  # NVLink-like, ms
    assert cm.comm(0, (0,), (1,)) == pytest.approx((8.0, 8.0))  # across servers
    assert cm.comm(0, (0, 1), (0, 1))[0] == pytest.approx(0.4)  # two parallel intra-server halves
    assert cm.comm(0, (0, 0), (1, 1))[0] == pytest.approx(8.0)  # two halves queue on server 0's uplink
    assert cm.comm(0, (0, 1), (1, 0))[0] == pytest.approx(4.0)  # one half each way: separate uplinks
    assert cm.comm(0, (0,), (0, 0))[0] == pytest.approx(0.8)  # a split: both halves leave one device link


def test_gradients_of_early_receivers_leave_early_only_on_held_links():
    """A split from one device: held, the first half lands after 0.4 ms and its gradients can start back while
    the second half is on the way (0.4 ms of the 0.8 ms way back overlaps); shared, both land at 0.8 ms."""
    prof = linear_profile([1.0] * 2, boundary=1e6)
    held = CostModel(prof, cluster(1, 3), micro_batch_size=8)
    shared = CostModel(prof, cluster(1, 3, link_sharing="shared"), micro_batch_size=8)
    assert held.comm_links(0, (0,), (0, 0)).chain == pytest.approx(0.4)
    assert shared.comm_links(0, (0,), (0, 0)).chain == pytest.approx(0.8)
    assert held.comm(0, (0,), (0, 0)) == shared.comm(0, (0,), (0, 0))  # the busiest link: the same


def test_the_drain_period_counts_each_link_one_way():
    """Stages of 2 -> 1 -> 1 replicas on servers 0 -> 1 -> 2: server 1's downlink takes 8 rows forward and 8
    rows of gradients back from server 2, its uplink the other way round, so the steady period holds both
    directions (16 ms) and the drain, with gradients alone, one (8 ms)."""
    cm = CostModel(linear_profile([1.0] * 3, boundary=1e6), cluster(3, 2), micro_batch_size=8)
    spans = [(0, 1, (0, 0)), (1, 2, (1,)), (2, 3, (2,))]
    assert cm.link_periods(spans) == pytest.approx((16.0, 8.0))


def test_latency_is_paid_per_route():
    cm = CostModel(linear_profile([1.0] * 2, boundary=1e6), cluster(2, 2, inter_lat=30e-6), micro_batch_size=8)
    assert cm.comm(0, (0, 0), (1, 1))[0] == pytest.approx(2 * (0.030 + 4.0))


def test_ring_allreduce_over_the_slowest_link():
    cm = CostModel(linear_profile([1.0, 1.0], params=[1e9, 0.0]), cluster(2, 2, intra_lat=1e-5, inter_lat=1e-4), 8)
    # 2 (r-1)/r * P / bw + 2 (r-1) * latency
    assert cm.allreduce(0, 2, (0, 0)) == pytest.approx(1e3 * (1e9 / 1e10 + 2 * 1e-5))
    assert cm.allreduce(0, 2, (0, 1)) == pytest.approx(1e3 * (1e9 / 1e9 + 2 * 1e-4))
    assert cm.allreduce(0, 2, (0, 0, 1, 1)) == pytest.approx(1e3 * (1.5 * 1e9 / 1e9 + 6 * 1e-4))
    assert cm.allreduce(0, 2, (1,)) == 0.0


def test_allreduce_uses_the_numbers_measured_for_the_group_size():
    c = cluster(1, 4)
    c.intra_allreduce_by_size = {2: [1e-5, 4e9], 4: [1e-4, 1e9]}
    cm = CostModel(linear_profile([1.0, 1.0], params=[1e9, 0.0]), c, 8)
    assert cm.allreduce(0, 2, (0, 0)) == pytest.approx(1e3 * (1e9 / 4e9 + 2 * 1e-5))
    assert cm.allreduce(0, 2, (0, 0, 0, 0)) == pytest.approx(1e3 * (1.5 * 1e9 / 1e9 + 6 * 1e-4))


def test_buckets_and_overlapped_ending():
    mb = 2**20
    prof = linear_profile([1.0, 1.0, 1.0, 1.0], params=[30 * mb, 0, 10 * mb, 10 * mb])
    cm = CostModel(prof, cluster(1, 4), 8)
    assert cm.buckets(0, 4) == [(2, 20 * mb), (0, 30 * mb)]  # backward order, 25 MiB cap, empty layers skipped
    lay = (0, 0)
    _, b = cm.compute(0, 4, 2)
    e = cm.overlapped_ending(0, 4, lay)
    assert b < e < b + cm.allreduce(0, 4, lay)  # the first bucket's AllReduce hides under the backward
    assert cm.overlapped_ending(0, 4, (0,)) == pytest.approx(cm.compute(0, 4, 1)[1])


def test_a_stage_pays_the_call_once():
    """Profile.call_ms is part of each layer's times (each was timed alone); a stage, run as one op, pays it once:
    its layers less the call (none below 0), plus the call. The search's own stage lists agree with compute()."""
    mb = 2**20
    prof = linear_profile([1.0, 0.1, 2.0], params=[30 * mb, 0, 30 * mb])  # at 8 rows: forward 8, 0.8, 16 ms;
    prof.call_ms = [1.0, 3.0]  # backward twice that
    cm = CostModel(prof, cluster(1, 4), micro_batch_size=8)
    assert cm.compute(0, 3, 1) == pytest.approx((7.0 + 0.0 + 15.0 + 1.0, 13.0 + 0.0 + 29.0 + 3.0))
    assert cm.compute(1, 2, 1) == pytest.approx((1.0, 3.0))  # cheaper than a call: the call alone
    assert cm.compute(2, 3, 2) == pytest.approx((8.0, 16.0))  # 4 rows: 8 - 1 + 1, 16 - 3 + 3
    assert [r for r, _ in cm.bucket_ready(0, 3, 8)] == pytest.approx([3.0 + 29.0, 3.0 + 29.0 + 0.0 + 13.0])

    from dapple.planner.search.dp import DPSearch, SearchConfig
    dp = DPSearch(prof, cluster(1, 4), 32, 8, SearchConfig(model="refined"))
    for j in range(3):
        fs, bs, _, _ = dp.costs.stage_costs(j, 2, False)
        for j2 in range(j + 1, len(fs)):
            assert (fs[j2], bs[j2]) == pytest.approx(cm.compute(j, j2, 2))


def test_bad_micro_batch():
    with pytest.raises(ValueError, match="micro_batch_size"):
        CostModel(linear_profile([1.0]), cluster(1, 1), 0)
