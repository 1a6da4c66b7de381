"""The bucketing rule shared by the runtime's gradient reducer and the planner's cost model."""

from __future__ import annotations

from dapple.core.buckets import bucket


def test_consecutive_items_share_a_bucket_while_they_fit():
    assert bucket([4, 4, 4, 10, 1], limit=8) == [[0, 1], [2], [3], [4]]
    assert bucket([], limit=8) == []
    assert bucket([9], limit=8) == [[0]]  # an item larger than the limit goes alone


def test_joins_breaks_a_bucket_where_items_cannot_share_a_buffer():
    kinds = ["f32", "f32", "bf16", "bf16"]
    assert bucket([1, 1, 1, 1], limit=100, joins=lambda i, j: kinds[i] == kinds[j]) == [[0, 1], [2, 3]]
