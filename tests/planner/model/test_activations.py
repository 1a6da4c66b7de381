"""Mixed precision and activation recomputation in the planner's models: bytes, memory, costs, recompute="auto"."""

from __future__ import annotations

import pytest

import dapple
from dapple import Plan
from dapple.planner import Stage, evaluate, simulate
from dapple.planner.model.cost import CostModel
from dapple.planner.model.memory import activation_scale

from ..helpers import cluster, linear_profile

# 4 layers of 1 ms per row forward (2 backward), 1e8 B saved and 1e6 B sent per row, 1e8 B of parameters each
PROF = linear_profile([1.0] * 4, params=1e8, boundary=1e6, saved=1e8)


def test_bf16_halves_the_activation_bytes_held_and_sent_but_not_the_allreduce():
    c = cluster(2, 2)
    full, half = CostModel(PROF, c, 8), CostModel(PROF, c, 8, mixed_precision="bf16")
    assert half.saved_bytes(0, 2, 1) == full.saved_bytes(0, 2, 1) / 2 == 8e8
    assert half.route_ms(1, 8, 0, 1) == pytest.approx(full.route_ms(1, 8, 0, 1) / 2)  # no latency: bytes / bw
    assert half.comm(1, (0,), (1,)) == pytest.approx(tuple(t / 2 for t in full.comm(1, (0,), (1,))))
    assert half.allreduce(0, 4, (0, 1)) == full.allreduce(0, 4, (0, 1)) > 0  # gradients stay fp32
    assert half.static_bytes(0, 4) == full.static_bytes(0, 4)
    assert half.compute(0, 4, 1) == full.compute(0, 4, 1)  # the profile's times
    assert activation_scale("fp16") == 0.5 and activation_scale(None) == 1.0
    with pytest.raises(ValueError, match=r"mixed_precision: expected one of \('bf16', 'fp16'\).*got 'fp8'"):
        CostModel(PROF, c, 8, mixed_precision="fp8")


def test_a_recomputing_stage_runs_its_forward_again_and_holds_its_inputs():
    cm = CostModel(PROF, cluster(1, 2), 8)
    f, b = cm.compute(1, 3, 1)
    assert cm.compute(1, 3, 1, recompute=True) == (f, b + f)  # backward += forward
    assert CostModel(PROF, cluster(1, 2), 8, recompute=True).compute(1, 3, 1) == (f, b + f)
    plain, again = cm.stage_bytes(1, 3, 1, False), cm.stage_bytes(1, 3, 1, True)
    assert plain.per_slice == 1.6e9 and plain.once == 0  # 8 rows x 2 layers x 1e8
    assert again.per_slice == 8e6 and again.once == 1.6e9  # the input of layer 1 per slice, one slice's activations
    assert again.peak(3) == 8e8 + 1.6e9 + 3 * 8e6 and plain.peak(3) == 8e8 + 3 * 1.6e9
    assert cm.stage_bytes(0, 2, 1, True).per_slice == 0  # the first stage's inputs: the caller's batch
    # the overlapped AllReduce's buckets wait for the recomputed forward
    assert cm.bucket_ready(0, 2, 8, True)[0][0] == pytest.approx(cm.bucket_ready(0, 2, 8)[0][0] + f)


def test_evaluate_prices_the_stages_recompute_and_the_plans_precision():
    c = cluster(1, 2)
    plain = Plan(32, 8, [Stage((0, 2), [0]), Stage((2, 4), [1])], warmup_policy="B")
    est = evaluate(PROF, c, plain, model="paper")
    rc = Plan(32, 8, [Stage((0, 2), [0], recompute=True), Stage((2, 4), [1])], warmup_policy="B")
    est_rc = evaluate(PROF, c, rc, model="paper")
    s0, r0 = est.details["stages"][0], est_rc.details["stages"][0]
    assert r0["backward_ms"] == pytest.approx(s0["backward_ms"] + s0["forward_ms"]) and r0["recompute"] is True
    assert "recompute" not in s0
    assert plain.stages[0].warmup == 3 and s0["memory_gb"] == pytest.approx((8e8 + 3 * 1.6e9) / 1e9)
    assert r0["memory_gb"] == pytest.approx((8e8 + 1.6e9) / 1e9)  # its inputs: the caller's batch
    # formula 2 with B_0 += F_0
    assert est_rc.latency_ms > est.latency_ms
    half = Plan(32, 8, [Stage((0, 2), [0]), Stage((2, 4), [1])], warmup_policy="B", mixed_precision="bf16")
    eh = evaluate(PROF, c, half)
    assert eh.details["mixed_precision"] == "bf16"
    assert eh.details["stages"][0]["send_forward_ms"] == pytest.approx(
        evaluate(PROF, c, plain).details["stages"][0]["send_forward_ms"] / 2)
    assert evaluate(PROF, c, half, mixed_precision="fp32").latency_ms == evaluate(PROF, c, plain).latency_ms


def test_recompute_lets_a_stage_hold_more_micro_batches_but_never_fit_one_it_could_not():
    c = cluster(1, 2, memory=3e9)
    cm = CostModel(PROF, c, 8)
    assert cm.fits(0, 2, 1) == 1 and cm.fits(0, 2, 1, recompute=True) > 1000  # 2.4 GB for one slice either way
    assert cm.fits(1, 4, 1) == 0 and cm.fits(1, 4, 1, recompute=True) == 0  # 1.2 + 2.4 GB: neither
    # gpipe holds every micro-batch: there recomputation is what makes the plan fit
    gp = Plan(32, 8, [Stage((0, 2), [0]), Stage((2, 4), [1])], schedule="gpipe")
    with pytest.raises(ValueError, match=r"stage 0 does not fit.*activation recomputation"):
        evaluate(PROF, c, gp)
    est = evaluate(PROF, c, gp, recompute="auto")
    assert [s.get("recompute", False) for s in est.details["stages"]] == [True, True]
    assert all(s["memory_gb"] <= 3 for s in est.details["stages"])


def test_auto_recomputes_only_where_k_i_would_drop_and_only_if_faster():
    tight = cluster(1, 2, memory=3e9)  # a stage of 2 layers holds one micro-batch's activations, no more
    plans = {rc: dapple.plan(PROF, tight, 32, 8, recompute=rc, verify=0) for rc in (False, True, "auto")}
    assert [s.recompute for s in plans[False].stages] == [False, False]
    assert plans[False].warmup == [1, 1]
    assert [s.recompute for s in plans[True].stages] == [True, True]
    auto = plans["auto"]
    # stage 0 recomputes to hold 3 micro-batches (policy B); the last stage needs K = 1 and does not
    assert [s.recompute for s in auto.stages] == [True, False] and auto.warmup == [3, 1]
    assert auto.estimate.latency_ms < min(plans[False].estimate.latency_ms, plans[True].estimate.latency_ms)
    assert auto.meta["recompute"] == "auto" and "latency_lower_bound_ms" not in auto.meta
    assert evaluate(PROF, tight, auto).latency_ms == auto.estimate.latency_ms  # what the plan records
    # memory to spare: no stage recomputes, the same plan as without
    ample = cluster(1, 2, memory=1e12)
    off, on = (dapple.plan(PROF, ample, 32, 8, recompute=rc, verify=0) for rc in (False, "auto"))
    assert not any(s.recompute for s in on.stages)
    assert [(s.layers, s.devices, s.warmup) for s in on.stages] == [(s.layers, s.devices, s.warmup)
                                                                     for s in off.stages]
    assert on.estimate.latency_ms == off.estimate.latency_ms


def test_plan_records_mixed_precision_and_bf16_can_make_a_plan_fit():
    c = cluster(1, 2, memory=2.2e9)  # 2 layers per stage: 0.8 GB static + 1.6 GB activations in fp32, 0.8 in bf16
    with pytest.raises(ValueError, match=r"no plan of linear fits.*or mixed_precision=bf16"):
        dapple.plan(PROF, c, 32, 8, verify=0)
    p = dapple.plan(PROF, c, 32, 8, mixed_precision="bf16", verify=0)
    assert p.mixed_precision == "bf16" and "mixed precision bf16" in str(p)
    assert Plan.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match=r"recompute: expected one of \(False, True, 'layers', 'selective', 'auto'\), "
                                             r"got 'yes'"):
        dapple.plan(PROF, c, 32, 8, recompute="yes")
    with pytest.raises(ValueError, match=r"mixed_precision: expected one of \('bf16', 'fp16'\).*got 'half'"):
        dapple.plan(PROF, c, 32, 8, mixed_precision="half")


@pytest.mark.parametrize("overlap", [False, True])
def test_the_simulator_agrees_with_the_refined_model_on_such_plans(overlap):
    c = cluster(1, 4, memory=1e12)
    prof = linear_profile([1.0] * 4, params=2e7, boundary=1e6, saved=1e8)
    for mp in (None, "bf16"):
        plan = Plan(32, 8, [Stage((0, 1), [0, 1], recompute=True), Stage((1, 3), [2]), Stage((3, 4), [3],
                                                                                              recompute=True)],
                    warmup_policy="B", mixed_precision=mp)
        est = evaluate(prof, c, plan, model="refined", overlap=overlap).latency_ms
        sim = simulate(plan, prof, c, overlap=overlap).latency_ms
        assert est == pytest.approx(sim, rel=0.01), (mp, est, sim)
    tight = cluster(1, 2, memory=3e9)
    auto = dapple.plan(PROF, tight, 32, 8, recompute="auto", verify=0)
    assert auto.estimate.latency_ms == pytest.approx(simulate(auto, PROF, tight).latency_ms, rel=0.01)


def test_auto_with_the_simulators_choice_records_the_simulated_latency_of_the_plan_it_returns():
    tight = cluster(1, 2, memory=3e9)
    auto = dapple.plan(PROF, tight, 32, 8, recompute="auto")  # verify: candidates simulated
    assert [s.recompute for s in auto.stages] == [True, False]
    assert auto.meta["simulated_ms"] == pytest.approx(simulate(auto, PROF, tight).latency_ms, abs=1e-4)


def test_auto_recomputation_keeps_what_a_zero_bubble_plan_needs_to_hold_k0():
    """Under zb-h1 the last stage holds K_0 micro-batches until their W: where only recomputation makes that fit,
    recompute="auto" keeps it there even though K_i = 1 would fit without (the plan returned fits: evaluate
    checks zb-h1's holds)."""
    tight = cluster(1, 2, memory=3e9)  # a stage of 2 layers holds one micro-batch's activations, no more
    zb = dapple.plan(PROF, tight, 32, 8, recompute="auto", schedule="zb-h1")
    assert zb.schedule == "zb-h1" and [s.recompute for s in zb.stages] == [True, True]
    assert evaluate(PROF, tight, zb).latency_ms == pytest.approx(zb.estimate.latency_ms)
    plain = dapple.plan(PROF, tight, 32, 8, recompute="auto")  # 1F1B: the last stage holds one, no recomputation
    assert [s.recompute for s in plain.stages] == [True, False]


def _measured(kept: float, ms: float):
    """PROF with selective recomputation measured: ``kept`` bytes and ``ms`` ms per row of every layer."""
    import dataclasses
    layers = [dataclasses.replace(x, selective_bytes=[kept * 8], selective_ms=[ms * 8]) for x in PROF.layers]
    return dataclasses.replace(PROF, layers=layers)


def test_layer_by_layer_keeps_every_layers_inputs_and_recomputes_one_layer_at_a_time():
    cm = CostModel(PROF, cluster(1, 2), 8)
    f, b = cm.compute(1, 4, 1)
    assert cm.compute(1, 4, 1, recompute="layers") == (f, b + f)  # every layer once again: the whole forward
    layers = cm.stage_bytes(1, 4, 1, "layers")
    assert layers.per_slice == 3 * 8e6  # the inputs of layers 1, 2 and 3 (1e6 B per row each)
    assert layers.once == 8e8  # one layer's activations at a time (the whole stage: 2.4e9)
    assert cm.stage_bytes(1, 4, 1, True).once == 2.4e9
    est = evaluate(PROF, cluster(1, 2), Plan(32, 8, [Stage((0, 2), [0], recompute="layers"), Stage((2, 4), [1])]))
    assert est.details["stages"][0]["recompute"] == "layers"


def test_selective_recomputation_is_priced_from_what_the_profile_measured():
    prof = _measured(kept=3e7, ms=0.25)
    cm = CostModel(prof, cluster(1, 2), 8)
    f, b = cm.compute(1, 3, 1)
    assert cm.compute(1, 3, 1, recompute="selective") == pytest.approx((f, b + 2 * 0.25 * 8))
    sel = cm.stage_bytes(1, 3, 1, "selective")
    assert sel.per_slice == pytest.approx(8e6 + 2 * 3e7 * 8)  # its input and what the two layers keep
    assert sel.once == pytest.approx(1.6e9 - 2 * 3e7 * 8)  # the rest, run again for one slice
    assert CostModel(prof, cluster(1, 2), 8, mixed_precision="bf16").stage_bytes(1, 3, 1, "selective").per_slice \
        == pytest.approx(sel.per_slice / 2)
    assert cm.bucket_ready(0, 2, 8, "selective")[0][0] == pytest.approx(cm.bucket_ready(0, 2, 8)[0][0] + 2 * 2)
    plan = dapple.plan(prof, cluster(1, 2), 32, recompute="selective", micro_batch_sizes=[8])
    assert {s.recompute for s in plan.stages} == {"selective"}


def test_selective_recomputation_needs_a_profile_that_measured_it():
    with pytest.raises(ValueError, match=r"recompute='selective': the profile of 'linear' has no selective "
                                         r"recomputation measurements \(selective_bytes, selective_ms\) for layers "
                                         r"\['layer0', 'layer1', 'layer2', 'layer3'\]; profile the model again with "
                                         r"dapple.profile\(..., selective=True\) \(dapple profile --selective\)"):
        CostModel(PROF, cluster(1, 2), 8, recompute="selective")
