"""Device memory: parameters x optimizer factor + K_i saved slices; D; errors that say which stage and by how much."""

from __future__ import annotations

import pytest

from dapple.planner import evaluate
from dapple.planner.model.memory import check_stage_memory, slices_that_fit, stage_memory

from ..helpers import cluster, linear_profile


def test_slices_that_fit():
    assert slices_that_fit(4e9, 1e9, 16e9) == 12
    assert slices_that_fit(15.5e9, 1e9, 16e9) == 0  # not even one slice fits
    assert slices_that_fit(17e9, 0, 16e9) == 0
    assert slices_that_fit(1e9, 0, 16e9) > 1000  # nothing saved: unbounded
    assert stage_memory(4e9, 1e9, 3) == 7e9


def test_error_names_stage_and_excess():
    with pytest.raises(ValueError, match=r"stage 2 does not fit.*exceeds by 1\.500 GB"):
        check_stage_memory(2, 16e9, 1.5e9, 16e9)


def test_evaluate_rejects_a_plan_that_does_not_fit():
    # 1 GB of parameters per layer x optimizer factor 4 = 4 GB per layer; 8 GB devices
    prof = linear_profile([1.0] * 4, params=1e9, saved=1e6)
    c = cluster(1, 4, memory=8e9)
    with pytest.raises(ValueError, match=r"stage 0 does not fit in device memory.*12\.012 GB.*exceeds by 4\.012 GB"):
        evaluate(prof, c, [(0, 3, [0, 1]), (3, 4, [2, 3])], 32, 8)
    evaluate(prof, c, [(0, 1, [0]), (1, 2, [1]), (2, 3, [2]), (3, 4, [3])], 32, 8)  # one layer per device fits
    est = evaluate(prof, c, [(0, 1, [0]), (1, 2, [1]), (2, 3, [2]), (3, 4, [3])], 32, 8, optimizer_factor=1)
    assert est.details["stages"][0]["memory_gb"] == pytest.approx(1 + 4 * 8e6 / 1e9)  # params + K_0 x slice


def test_k_i_is_capped_by_d_and_an_explicit_k_is_checked():
    prof = linear_profile([1.0] * 2, params=0, saved=1e8)  # a slice of 8 rows saves 0.8 GB
    c = cluster(1, 2, memory=2e9)  # D = 2
    est = evaluate(prof, c, [(0, 1, [0]), (1, 2, [1])], 64, 8, warmup_policy="B")
    assert [s["warmup"] for s in est.details["stages"]] == [2, 1]  # policy B wants 3: capped by D = 2
    assert est.details["stages"][0]["max_in_flight"] == 2
    from dapple.planner import Stage
    with pytest.raises(ValueError, match=r"stage 0 does not fit.*3 x 0\.800 GB"):
        evaluate(prof, c, [Stage((0, 1), [0], 3), Stage((1, 2), [1], 1)], 64, 8)


def test_what_does_not_fit_is_a_no_fit_error_a_value_error():
    """A stage, a given K_i or every plan that does not fit raises NoFitError, a ValueError: what the planner's
    callers catch to mean "does not fit" (a bad argument stays a plain ValueError, which they let through)."""
    from dapple import plan
    from dapple.planner import NoFitError, Stage

    assert issubclass(NoFitError, ValueError)
    prof = linear_profile([1.0] * 4, params=1e9, saved=1e6)
    c = cluster(1, 4, memory=8e9)
    with pytest.raises(NoFitError, match="stage 0 does not fit"):
        evaluate(prof, c, [(0, 3, [0, 1]), (3, 4, [2, 3])], 32, 8)
    with pytest.raises(NoFitError, match=r"stage 0 does not fit.*3 x"):
        evaluate(linear_profile([1.0] * 2, saved=1e8), cluster(1, 2, memory=2e9),
                 [Stage((0, 1), [0], 3), Stage((1, 2), [1], 1)], 64, 8)
    with pytest.raises(NoFitError, match="no plan of linear fits"):
        plan(linear_profile([1.0] * 4, params=2e9), cluster(1, 4, memory=4e9), 32, 8)
    with pytest.raises(ValueError, match="global_batch_size") as bad:
        plan(prof, c, 0, recompute="auto")
    assert not isinstance(bad.value, NoFitError)
