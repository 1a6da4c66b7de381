"""The brute-force oracle itself: every distinct device assignment and stage split, each once."""

from __future__ import annotations

import itertools
import math

import pytest

from dapple.planner.baselines.exhaustive import assignments, every_plan
from dapple.planner.model.cost import CostModel

from ..helpers import cluster, linear_profile


def _compositions(G: int, S: int, most: int) -> int:
    """Ways to cut G devices in a row into S non-empty runs of at most ``most``."""
    return sum(1 for cuts in itertools.combinations(range(1, G), S - 1)
               if all(b - a <= most for a, b in itertools.pairwise((0, *cuts, G))))


@pytest.mark.parametrize("servers, per, S, most", [(1, 4, 1, 4), (1, 4, 2, 4), (2, 2, 1, 4), (2, 2, 2, 2),
                                                   (2, 2, 2, 4), (2, 2, 3, 4), (4, 1, 2, 4), (2, 3, 3, 2)])
def test_assignments_are_every_distinct_server_layout(servers, per, S, most):
    c = cluster(servers, per)
    G = c.num_devices
    lays = list(assignments(c, S, most))
    assert len(lays) == len(set(lays))
    # a layout is a row of server labels (each server's `per` devices interchangeable) cut into S runs
    rows = math.factorial(G) // math.factorial(per) ** servers
    assert len(lays) == rows * _compositions(G, S, most)
    for lay in lays:
        assert len(lay) == S and all(1 <= len(st) <= most for st in lay)
        assert sorted(s for st in lay for s in st) == sorted(list(range(servers)) * per)


def test_every_plan_is_each_split_times_each_assignment():
    prof = linear_profile([1.0, 2.0, 3.0], boundary=1e3)  # no parameters, ample memory: every plan fits
    c = cluster(2, 2)
    plans = [spans for spans, _, _ in every_plan(prof, c, 4, CostModel(prof, c, 4))]
    want = sum(math.comb(3 - 1, S - 1) * len(list(assignments(c, S, 4))) for S in (1, 2, 3))
    # 4!/(2!2!) = 6 rows of labels; S = 1: 6 x 1 run x 1 split, S = 2: 6 x 3 x 2, S = 3: 6 x 3 x 1
    assert len(plans) == len(set(plans)) == want == 6 + 36 + 18
    for spans in plans:
        assert spans[0][0] == 0 and spans[-1][1] == 3
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
