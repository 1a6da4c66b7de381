"""Split-concat routes: slices are nearly even, routes tile the micro-batch exactly once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dapple.core.split_concat import Route, routes, slice_bounds


def test_slices_like_tensor_split():
    assert slice_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ValueError, match="cannot split 2 rows over 3 replicas"):
        slice_bounds(2, 3)


def test_one_to_many_many_to_one_many_to_many():
    assert routes(6, 1, 3) == [Route(0, 0, 0, 2), Route(0, 1, 2, 4), Route(0, 2, 4, 6)]
    assert routes(6, 3, 1) == [Route(0, 0, 0, 2), Route(1, 0, 2, 4), Route(2, 0, 4, 6)]
    assert routes(5, 2, 3) == [Route(0, 0, 0, 2), Route(0, 1, 2, 3), Route(1, 1, 3, 4), Route(1, 2, 4, 5)]


@given(rows=st.integers(1, 64), s=st.integers(1, 8), r=st.integers(1, 8))
def test_routes_tile_rows_once(rows, s, r):
    if rows < max(s, r):
        return
    rs = routes(rows, s, r)
    covered = sorted((x.start, x.end) for x in rs)
    assert covered[0][0] == 0 and covered[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    src, dst = slice_bounds(rows, s), slice_bounds(rows, r)
    for x in rs:
        assert src[x.src][0] <= x.start < x.end <= src[x.src][1]
        assert dst[x.dst][0] <= x.start < x.end <= dst[x.dst][1]
