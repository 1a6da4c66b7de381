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


def test_static_factor_shards_the_optimizer_part():
    from dapple.planner.model.memory import static_factor
    assert static_factor(4.0) == static_factor(4.0, 1) == 4.0  # fp32 weights, gradients, Adam's two moments
    assert static_factor(4.0, 4) == 2.5  # weights and gradients whole, 1/4 of the two moments
    assert static_factor(3.0, 2) == 2.5  # SGD with momentum: one moment
    assert static_factor(1.0, 8) == 1.0  # nothing of an optimizer to shard


def test_evaluate_prices_a_sharded_optimizer_per_replica():
    """A stage on r replicas with sharding holds params x (2 + 2 / r) + K_i slices; a stage of one replica, as
    without; a plan that fits only thanks to it raises without, and a Plan's own flag is the default."""
    prof = linear_profile([1.0] * 4, params=1e9, saved=1e6)  # 1 GB of parameters per layer, 8 MB per 8-row slice
    stages = [(0, 2, [0, 1, 2, 3]), (2, 3, [4]), (3, 4, [5])]
    c = cluster(1, 6, memory=6e9)  # unsharded, stage 0 needs 8 GB; sharded over 4: 2 x (2 + 2/4) = 5 GB
    with pytest.raises(ValueError, match=r"stage 0 does not fit.*8\.0\d\d GB"):
        evaluate(prof, c, stages, 32, 8)
    est = evaluate(prof, c, stages, 32, 8, shard_optimizer=True)
    per = est.details["stages"]
    assert est.details["shard_optimizer"] is True
    slice_gb = 8 * 1e6 / 1e9  # the slowest replica's 2 rows of the micro-batch x 2 layers = 4 MB; K_0 of them
    assert per[0]["memory_gb"] == pytest.approx(2 * 2.5 + per[0]["warmup"] * 2 * 2 * 1e6 / 1e9)
    assert per[1]["memory_gb"] == pytest.approx(4 + per[1]["warmup"] * slice_gb)  # one replica: nothing sharded
    plan = dapple.Plan(32, 8, [Stage((a, c_), d) for a, c_, d in stages], shard_optimizer=True)
    assert evaluate(prof, c, plan).details["stages"] == per  # the plan's own flag
    with pytest.raises(ValueError, match="stage 0 does not fit"):
        evaluate(prof, c, plan, shard_optimizer=False)
    with pytest.raises(TypeError, match="shard_optimizer: expected True or False"):
        evaluate(prof, c, stages, 32, 8, shard_optimizer="yes")


def test_plan_with_shard_optimizer_finds_plans_that_fit_only_thanks_to_it():
    """Layer 0 holds 1 GB of parameters: 4 GB unsharded on any stage holding it, more than a device's 3.2 GB,
    so no plan fits; sharded over r >= 2 replicas it holds 2 + 2/r GB. The plan records it, in YAML too."""
    prof = linear_profile([1.0] * 4, params=[1e9, 1e6, 1e6, 1e6], saved=1e5)
    c = cluster(1, 4, memory=3.2e9)
    with pytest.raises(ValueError, match="no plan of linear fits.*shard_optimizer=True"):
        dapple.plan(prof, c, global_batch_size=16, micro_batch_size=4, workers=1)
    p = dapple.plan(prof, c, global_batch_size=16, micro_batch_size=4, workers=1, shard_optimizer=True)
    assert p.shard_optimizer is True and p.estimate.details["shard_optimizer"] is True
    first = p.stages[0]
    assert first.layers[0] == 0 and first.replicas >= 2
    assert p.estimate.details["stages"][0]["memory_gb"] <= 3.2
    assert evaluate(prof, c, p).latency_ms == p.estimate.latency_ms  # re-evaluated with the plan's own flag
    with pytest.raises(ValueError, match="stage 0 does not fit"):
        evaluate(prof, c, p, shard_optimizer=False)
    again = dapple.Plan.from_dict(p.to_dict())
    assert again.shard_optimizer is True and again.to_dict() == p.to_dict()
    assert "optimizer state sharded over each stage's replicas" in str(p)
    assert "shard_optimizer" not in dapple.Plan(16, 4, [Stage((0, 4), [0])]).to_dict()  # off: not written


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
