"""Fresh First, Append First, Scatter First (paper IV-B) over per-server free-device counts."""

from __future__ import annotations

from dapple.planner.search.placement import append_first, fresh_first, placements, scatter_first


def test_all_servers_fresh():
    free = [4, 4]
    assert fresh_first(free, 4, 3) == [3, 0]  # one server's fast links
    assert append_first(free, 4, 3) == [3, 0]  # nothing used yet: falls back to fresh servers
    assert scatter_first(free, 4, 3) == [2, 1]  # evenly over all servers when all are fresh
    assert fresh_first(free, 4, 6) == [4, 2]  # a whole server, then the next


def test_partly_used_servers():
    free = [2, 4]  # server 0 has 2 devices taken
    assert fresh_first(free, 4, 3) == [0, 3]
    assert append_first(free, 4, 3) == [2, 1]  # fill the used server first
    assert scatter_first(free, 4, 3) == [2, 1]  # the used servers first, then any
    free = [1, 3, 4]
    assert append_first(free, 4, 2) == [0, 2, 0]  # the used server that fits the stage most tightly
    assert fresh_first(free, 4, 2) == [0, 0, 2]
    assert scatter_first(free, 4, 2) == [1, 1, 0]  # evenly over the used servers
    assert scatter_first(free, 4, 6) == [1, 3, 2]


def test_preference_order_breaks_ties():
    free = [2, 2, 4]
    assert append_first(free, 4, 2, order=[1, 0, 2]) == [0, 2, 0]
    assert fresh_first(free, 4, 1, order=[2, 1, 0]) == [0, 0, 1]


def test_impossible_and_deduplicated():
    assert fresh_first([1, 1], 4, 3) is None
    assert scatter_first([0, 0], 1, 1) is None
    assert placements([1, 1, 1, 1], 1, 2) == [("fresh", [1, 1, 0, 0])]  # one device per server: all policies agree
    names = [n for n, _ in placements([4, 4], 4, 3)]
    assert names == ["fresh", "scatter"]  # append gives the same as fresh here
