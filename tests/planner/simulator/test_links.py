"""Max-min fair sharing of links between concurrent transfers (the simulator's links="shared")."""

from __future__ import annotations

import pytest

from dapple.planner.simulator.links import SharedLinks


def _run(flows):
    """Add (start, id, work, links) transfers in time order; return {id: finish time}."""
    net, done, pending = SharedLinks(), {}, sorted(flows)
    while pending or net.flows:
        nxt = net.next_done()
        if pending and (nxt is None or pending[0][0] <= nxt[0]):
            t, fid, work, links = pending.pop(0)
            net.add(t, fid, work, links, None)
        else:
            net.finish(*nxt)
            done[nxt[1]] = nxt[0]
    return done


def test_two_transfers_on_one_link_share_it():
    assert _run([(0.0, 1, 10.0, ("a",)), (0.0, 2, 10.0, ("a",))]) == {1: pytest.approx(20.0), 2: pytest.approx(20.0)}
    # a later, shorter transfer: 1 runs alone 4 ms, then both at half rate until 2's 2 ms are done (4 ms), then
    # 1 alone again for its last 10 - 4 - 2 = 4 ms
    assert _run([(0.0, 1, 10.0, ("a",)), (4.0, 2, 2.0, ("a",))]) == {2: pytest.approx(8.0), 1: pytest.approx(12.0)}


def test_rates_are_max_min_fair():
    """f2 crosses both links; link b has three transfers (1/3 each), so f1 gets what f2 leaves on link a."""
    net = SharedLinks()
    for fid, links in ((1, ("a",)), (2, ("a", "b")), (3, ("b",)), (4, ("b",))):
        net.add(0.0, fid, 100.0, links, None)
    assert net.rate == pytest.approx({1: 2 / 3, 2: 1 / 3, 3: 1 / 3, 4: 1 / 3})
    assert net.next_done() == (pytest.approx(150.0), 1)
    net.finish(150.0, 1)  # f1 done: link b still holds f2 to a third
    assert net.rate == pytest.approx({2: 1 / 3, 3: 1 / 3, 4: 1 / 3})


def test_disjoint_transfers_run_at_full_rate():
    assert _run([(0.0, 1, 5.0, ("a", "b")), (1.0, 2, 3.0, ("c", "d"))]) == {1: pytest.approx(5.0),
                                                                           2: pytest.approx(4.0)}
