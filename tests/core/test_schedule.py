"""Schedule generator: K_i policies, op order of dapple, gpipe and zb-h1, activations alive, deadlock-free K_i."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dapple.core.schedule import (
    Op,
    most_warmup,
    most_warmups,
    peak_in_flight,
    pipeline_stage_ops,
    policy_warmup,
    stage_holds,
    stage_ops,
    validate_warmup,
    warmup_counts,
)


def test_policies():
    assert warmup_counts(4, 8, "A") == [4, 3, 2, 1]
    assert warmup_counts(4, 8, "B") == [7, 5, 3, 1]
    assert warmup_counts(4, 3, "B") == [3, 3, 3, 1]  # never more than M
    assert warmup_counts(3, 8, "B", max_in_flight=2) == [2, 2, 1]  # D caps K_i
    assert warmup_counts(3, 8, "A", max_in_flight=[1, 3, 3]) == [1, 1, 1]  # and K_i never increases


@given(st.integers(1, 12), st.integers(-1, 40), st.integers(1, 40))
def test_the_most_k_any_policy_allows_is_policy_b_within_d_and_m(stages, d, m):
    """most_warmup (what the planner's bounds assume of a stage with ``stages`` stages from it to the last) is the
    larger policy's K_i alone, as warmup_counts gives it with D for that stage; most_warmups lists it per count."""
    assert policy_warmup("A", stages) <= policy_warmup("B", stages)
    alone = max(warmup_counts(stages, m, pol, max_in_flight=[d] + [1 << 30] * (stages - 1))[0] for pol in "AB")
    assert most_warmup(stages, d, m) == alone
    assert most_warmups(stages, d, m) == [most_warmup(s, d, m) for s in range(1, stages + 1)]


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


def test_zb_h1_order_s4_m8():
    """Stage i defers W while K_0 - K_i micro-batches wait for theirs; the rest fill the cool-down."""
    rows = [" ".join(map(str, pipeline_stage_ops("zb-h1", 8, [4, 3, 2, 1], i))) for i in range(4)]
    assert rows == [
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
        "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
        "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7",
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
    ]


@given(m=st.integers(1, 30), k=st.integers(1, 35), extra=st.integers(0, 35))
def test_zb_h1_keeps_dapple_order_and_holds_at_most_hold(m, k, extra):
    ops = stage_ops("zb-h1", m, k, k + extra)
    assert [o for o in ops if o.kind != "W"] == stage_ops("dapple", m, k)  # F and B exactly as dapple
    assert [o.micro_batch for o in ops if o.kind == "W"] == list(range(m))
    done_b = set()
    for op in ops:  # each W after its own B
        if op.kind == "B":
            done_b.add(op.micro_batch)
        if op.kind == "W":
            assert op.micro_batch in done_b
    assert peak_in_flight(ops) == min(m, k + extra)  # held from F to W (W needs what the forward saved)
    assert peak_in_flight(stage_ops("zb-h1", m, k)) == min(k, m)  # no hold given: W never deferred past K


def test_zb_h1_holds_the_first_stage_k_everywhere():
    assert stage_holds([4, 3, 2, 1], 8) == [4, 4, 4, 4]
    assert stage_holds([4, 3, 2, 1], 3) == [3, 3, 3, 3]
    assert stage_holds([8, 9], 8) == [8, 8]  # K_0 = M allows a larger K_1, which acts as M
    for i in range(4):
        assert peak_in_flight(pipeline_stage_ops("zb-h1", 8, [4, 3, 2, 1], i)) == 4
    with pytest.raises(ValueError, match="hold"):
        stage_ops("zb-h1", 4, 2, 0)
