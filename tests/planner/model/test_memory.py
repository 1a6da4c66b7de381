"""Device memory: parameters x optimizer factor + K_i saved slices; D; errors that say which stage and by how much."""

from __future__ import annotations

import pytest

import dapple
from dapple.planner import Stage, evaluate, memory_needed
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


def test_memory_needed_is_what_one_device_needs_and_below_it_the_plan_is_a_pipeline():
    prof = linear_profile([1.0] * 6, params=1e8, saved=1e6, boundary=1e5)  # 0.6 GB of parameters, 1 MB/row saved
    need = memory_needed(prof, 4)
    assert need == pytest.approx(4 * 6e8 + 4 * 6e6)  # parameters x 4 + one micro-batch of 4 rows' activations
    assert memory_needed(prof, 4, mixed_precision="bf16") == pytest.approx(4 * 6e8 + 2 * 6e6)
    assert memory_needed(prof, 4, optimizer_factor=2.0) == pytest.approx(2 * 6e8 + 4 * 6e6)
    whole = [Stage((0, 6), [0], warmup=1)]
    evaluate(prof, cluster(1, 1, memory=need), whole, 4, 4)  # exactly enough: the whole model on one device fits
    with pytest.raises(ValueError, match="stage 0 does not fit"):
        evaluate(prof, cluster(1, 1, memory=0.99 * need), whole, 4, 4)
    tight = dapple.plan(prof, cluster(1, 4, memory=0.6 * need), global_batch_size=16, micro_batch_size=4)
    assert tight.num_stages > 1
