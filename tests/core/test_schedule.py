"""Schedule generator: K_i policies, op order of dapple and gpipe, activations alive, deadlock-free K_i."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dapple.core.schedule import Op, peak_in_flight, stage_ops, validate_warmup, warmup_counts


def test_policies():
    assert warmup_counts(4, 8, "A") == [4, 3, 2, 1]
    assert warmup_counts(4, 8, "B") == [7, 5, 3, 1]
    assert warmup_counts(4, 3, "B") == [3, 3, 3, 1]  # never more than M
    assert warmup_counts(3, 8, "B", max_in_flight=2) == [2, 2, 1]  # D caps K_i
    assert warmup_counts(3, 8, "A", max_in_flight=[1, 3, 3]) == [1, 1, 1]  # and K_i never increases


def test_dapple_order_matches_paper_fig4():
    ops = [str(o) for o in stage_ops("dapple", 5, 2)]
    assert ops == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "F4", "B3", "B4"]


def test_gpipe_order():
    assert [str(o) for o in stage_ops("gpipe", 3, 1)] == ["F0", "F1", "F2", "B0", "B1", "B2"]


@given(m=st.integers(1, 40), k=st.integers(1, 50))
def test_at_most_k_alive_whatever_m(m, k):
    ops = stage_ops("dapple", m, k)
    assert sorted(ops) == sorted([Op("F", j) for j in range(m)] + [Op("B", j) for j in range(m)])
    assert peak_in_flight(ops) == min(k, m)
    seen = set()
    for op in ops:  # every backward after its forward
        if op.kind == "B":
            assert op.micro_batch in seen
        seen.add(op.micro_batch)
    for kind in "FB":  # forwards and backwards each oldest first
        assert [o.micro_batch for o in ops if o.kind == kind] == list(range(m))


def test_increasing_warmup_is_rejected_with_values():
    with pytest.raises(ValueError, match=r"K_1=3 exceeds K_0=2"):
        validate_warmup([2, 3], 8)
    validate_warmup([8, 9], 8)  # K_0 = M: stage 0 runs every forward first, nothing to wait on
    for bad in (0, True, 1.0):
        with pytest.raises(ValueError, match=f"K_0 must be a positive integer, got {bad}"):
            validate_warmup([bad], 8)


def test_unknown_names():
    with pytest.raises(ValueError, match="schedule must be one of"):
        stage_ops("1f1b", 4, 1)
    with pytest.raises(ValueError, match="warmup policy must be one of"):
        warmup_counts(2, 4, "C")
