"""Communication-stage tables: split-concat routes over the topology's links, and the gradients' stagger credit."""

from __future__ import annotations

import numpy as np
import pytest

from dapple.core.split_concat import routes
from dapple.planner.model.cost import CostModel
from dapple.planner.model.transfers import CommPair, add_users, feeds, gradient_ports, queues, route_links

from ..helpers import cluster, linear_profile


def _edge(c, link: tuple) -> tuple:
    """The directed edge of ``Cluster.graph()`` a link of ``route_links`` names."""
    kind, who = link
    if kind in ("out", "xout"):  # a device's link to its server's switch, outwards
        return ("device", who), ("server", c.server_of(who))
    if kind in ("in", "xin"):
        return ("server", c.server_of(who)), ("device", who)
    return (("server", who), "network") if kind == "up" else ("network", ("server", who))


def test_route_links_follow_the_topology_graph():
    c = cluster(2, 2)
    for a, b, kinds in [(0, 1, ["out", "in"]), (3, 2, ["out", "in"]), (0, 3, ["xout", "up", "down", "xin"]),
                        (2, 1, ["xout", "up", "down", "xin"])]:
        links = route_links(a, b, c.server_of(a), c.server_of(b))
        path = c.path(a, b)  # device -> switch -> device, or device -> server -> network -> server -> device
        assert [k for k, _ in links] == kinds
        assert [_edge(c, link) for link in links] == list(zip(path, path[1:]))


def _times(rows: int, same_server: bool) -> np.ndarray:
    return np.array([rows * (1.0 if same_server else 10.0)] * 3)  # (N=3,) ms at every cut


def test_a_concat_gets_no_stagger_credit():
    # 2 replicas on server 0 -> 1 on server 1: both routes cross server 1's downlink, one after the other
    pair = CommPair(routes(8, 2, 1), (0, 0), (1,), _times)
    for cut in range(3):
        busiest, out, inc, ud, chain, window, hot = pair.at(cut)
        assert busiest == pytest.approx(80.0)  # 2 routes x 4 rows x 10 ms
        assert inc == pytest.approx(80.0) and out == pytest.approx(40.0)
        assert ud == ((0, 80.0, 0.0), (1, 0.0, 80.0))
        assert chain == pytest.approx(busiest)  # one receiver: its gradients leave after all its data is in
        assert window == pytest.approx(busiest)
        assert hot == (("down", 1),)  # the receiver server's downlink (its device link is an "xin": not tracked)


def test_a_split_credits_the_early_receivers_gradients_unless_links_are_shared():
    # 1 replica on server 0 -> 2 on servers 1 and 2: the uplink carries both routes; the first lands at 40 ms
    busiest, _, _, _, chain, window, _ = CommPair(routes(8, 1, 2), (0,), (1, 2), _times).at(1)
    assert busiest == pytest.approx(80.0)
    assert chain == pytest.approx(40.0)  # the second receiver's 40 ms back, after its data at 80 ms
    assert window == pytest.approx(40.0)  # max(longest 40, 80 - (80 - 40))
    assert CommPair(routes(8, 1, 2), (0,), (1, 2), _times, shared=True).at(1).chain == pytest.approx(busiest)


def test_cuts_with_other_bytes_get_their_own_numbers():
    # route times that differ by cut: each cut is priced on its own, cuts with equal times share one answer
    pair = CommPair(routes(8, 2, 1), (0, 0), (1,), lambda rows, same: np.array([1.0, 2.0, 1.0]) * rows)
    assert [pair.at(cut).busiest for cut in range(3)] == pytest.approx([8.0, 16.0, 8.0])
    assert pair.at(0) is pair.at(2)
    # a pair over many servers (keep=False) keeps no answer: the same numbers, made anew
    wide = CommPair(routes(8, 2, 1), (0, 0), (1,), lambda rows, same: np.array([1.0, 2.0, 1.0]) * rows, keep=False)
    assert wide.at(0) == pair.at(0) and wide.at(0) is not wide.at(2)


def test_one_micro_batch_round_trip_is_the_simulators_between_unequal_replica_counts():
    # 10 replicas -> 6 (one device per server): split-concat routes chain through alternately shared links, so
    # the last receiver's data lands well after its downlink's own load, and its gradients leave only then
    from dapple.planner import Plan, Stage, evaluate, simulate

    from ..helpers import linear_profile
    prof = linear_profile([0.01] * 4, boundary=1e6)  # transfers dwarf compute
    c = cluster(16, 1, inter=1e9)
    plan = Plan(1024, 1024, [Stage((0, 2), list(range(10))), Stage((2, 4), list(range(10, 16)))])  # 103/102 rows
    est = evaluate(prof, c, plan, model="refined").latency_ms
    sim = simulate(plan, prof, c).latency_ms  # 391.4 ms; the closed form before it: 290.4 ms
    assert est == pytest.approx(sim, rel=0.01)
    # the last receiver's data lands 204 ms after the first send, not after its downlink's 171 ms
    busiest, _, _, _, chain, window, _ = CommPair(routes(1024, 10, 6), tuple(range(10)), tuple(range(10, 16)),
                                                  lambda rows, same: np.array([rows / 6.0])).at(0)
    assert busiest == pytest.approx(171.0 / 6) and busiest + chain == pytest.approx((204.0 + 171.0) / 6)
    assert window == pytest.approx(103.0 / 6)  # the steady state's closed form: the longest route


def test_the_steady_state_windows_take_the_overlapped_share():
    # 13 -> 3 replicas, 32 micro-batches, K = 3, 1: stage 0's window of 3 micro-batches per round trip binds.
    # In the steady state early receivers' gradients overlap later forward routes (`window`); the first
    # micro-batch's round trip (`chain`) in the windows instead puts the plan 18.5% above the simulator
    from dapple.planner import Plan, Stage, evaluate, simulate

    from ..helpers import linear_profile
    prof = linear_profile([0.5, 0.5, 0.1, 0.1], boundary=6.5e5)
    c = cluster(16, 1, inter=1e9)
    plan = Plan(2048, 64, [Stage((0, 2), list(range(13))), Stage((2, 4), list(range(13, 16)))], warmup_policy="B")
    est = evaluate(prof, c, plan, model="refined")
    assert [s["warmup"] for s in est.details["stages"]] == [3, 1]
    assert est.latency_ms == pytest.approx(simulate(plan, prof, c).latency_ms, rel=0.02)


def test_gradients_queue_only_where_the_activations_hold_their_busiest_link():
    # CommPair's hot links and gradient_ports, through CostModel, on 3 servers of 2 devices
    cm = CostModel(linear_profile([1.0, 1.0], boundary=1e6), cluster(3, 2), 8)
    # 1 replica on server 0 -> 1 on server 1: its uplink and server 1's downlink carry the same load (hot)
    hot = cm.comm_links(0, (0,), (1,)).hot
    assert ("down", 1) in hot
    assert queues(hot, cm.comm_pair((1,), (2,)).ports)  # gradients from server 2 come in on that downlink
    assert not queues(hot, cm.comm_pair((1,), (1,)).ports)  # from server 1 itself: on the device link
    # 2 replicas on server 0 -> one on server 1 and one on server 2: server 0's uplink carries both (busiest)
    hot = cm.comm_links(0, (0, 0), (1, 2)).hot
    assert not any(k == "down" for k, _ in hot)
    assert not queues(hot, cm.comm_pair((1, 2), (0, 0)).ports)
    # 2 replicas on server 0 -> 2 on server 0: each receiver's own device link is a busiest link
    hot = cm.comm_links(0, (0, 0), (0, 0)).hot
    assert set(hot) == {("in", 0), ("in", 1)}
    assert gradient_ports(routes(8, 2, 1), (0, 0), (0,)) == (frozenset({0, 1}), frozenset())
    assert queues(hot, cm.comm_pair((0, 0), (0,)).ports)
    assert not queues(hot, cm.comm_pair((0, 0), (1,)).ports)
    # shared links: transfers start at once, nothing queues
    shared = CostModel(linear_profile([1.0, 1.0], boundary=1e6), cluster(3, 2, link_sharing="shared"), 8)
    assert shared.comm_links(0, (0,), (1,)).hot == ()


def test_a_shared_server_link_paces_the_warmup_of_the_stages_on_it():
    """comm.feeds: where a server's uplink carries two communication stages' activations, each gets through
    at its own load plus the other's, the other's counted at most as its own (a heavier stage is the slower
    flow: the lighter one's transfers wait for one of its routes at a time); a link with one stage: no floor."""
    users = add_users({}, ((0, 12.0, 0.0), (1, 0.0, 12.0)), 1)
    assert feeds(users, 5) is None  # each link carries one stage
    users = add_users(users, ((0, 10.0, 0.0), (1, 0.0, 0.5)), 3)
    assert feeds(users, 5) == [0.0, 22.0, 0.0, 20.0, 0.0]  # server 0's uplink: 12 + 10, 10 + 10
    users = add_users(users, ((1, 0.0, 40.0),), 5)  # server 1's downlink: 12, 0.5 and 40
    # stage 1: 12 + 0.5 + 12 there (its busiest); stage 3: 20 on server 0's uplink; stage 5: 40 + 12 + 0.5
    assert feeds(users, 7) == [0.0, 24.5, 0.0, 20.0, 0.0, 52.5, 0.0]
