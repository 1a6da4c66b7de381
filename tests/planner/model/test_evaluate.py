"""evaluate(): formula 2 over the cost model for any stages, input validation, details, print(plan)."""

from __future__ import annotations

import pytest

from dapple import Plan
from dapple import plan as make_plan
from dapple.planner import Stage, evaluate
from dapple.planner.model.pivot import paper_latency

from ..helpers import cluster, linear_profile


def _setup():
    # per row: forward 1, 2, 3, 4 ms; boundary 1e6 B; 1e8 B of parameters per layer
    prof = linear_profile([1.0, 2.0, 3.0, 4.0], params=1e8, boundary=1e6, saved=1e6)
    return prof, cluster(2, 2, intra=1e10, inter=1e9)


def test_two_stage_plan_by_hand():
    prof, c = _setup()
    # stage 0: layers 0-1 on devices 0, 1 (server 0), 4 rows each; stage 1: layers 2-3 on device 2 (server 1)
    est = evaluate(prof, c, [(0, 2, [0, 1]), (2, 4, [2])], 32, 8, model="paper", overlap=False)
    F0, B0 = 3.0 * 4, 6.0 * 4
    F1, B1 = 7.0 * 8, 14.0 * 8
    comm = 2 * 4e6 / 1e9 * 1e3  # two halves of 4e6 B queue on server 0's uplink: 8 ms
    AR0 = 1e3 * (2e8 / 1e10)  # 2 (r-1)/r P / bw with r = 2 inside server 0: 20 ms
    want = paper_latency([F0, comm, F1], [B0, comm, B1], [AR0, 0, 0], 4)
    assert est.latency_ms == pytest.approx(want.total)
    assert (est.warmup_ms, est.steady_ms, est.ending_ms) == pytest.approx((want.warmup, want.steady, want.ending))
    s0, s1 = est.details["stages"]
    assert (s0["forward_ms"], s0["backward_ms"], s0["allreduce_ms"], s0["send_forward_ms"]) == pytest.approx(
        (F0, B0, AR0, comm))
    assert (s1["forward_ms"], s1["allreduce_ms"], s1["warmup"]) == pytest.approx((F1, 0.0, 1))
    assert s0["warmup"] == 2 and s0["rows"] == 4
    assert 0 < est.details["bubble_fraction"] < 1 and est.details["acr"] > 0


@pytest.mark.parametrize("schedule, model", [("dapple", "paper"), ("dapple", "refined"), ("zb-h1", "refined")])
def test_a_profiles_step_cost_is_paid_once_per_step(schedule, model):
    """Profile.step_ms (the runtime's fixed cost per step) adds to the estimate and the simulated step, once."""
    from dapple import simulate
    prof, c = _setup()
    stages = [Stage((0, 2), [0, 1]), Stage((2, 4), [2])]
    plan = Plan(32, 8, stages, schedule=schedule)
    before = evaluate(prof, c, plan, model=model, overlap=True)
    sim = simulate(plan, prof, c, overlap=True).latency_ms
    prof.step_ms = 7.0
    after = evaluate(prof, c, plan, model=model, overlap=True)
    assert after.latency_ms == pytest.approx(before.latency_ms + 7.0)
    assert after.ending_ms == pytest.approx(before.ending_ms + 7.0) and after.warmup_ms == before.warmup_ms
    assert simulate(plan, prof, c, overlap=True).latency_ms == pytest.approx(sim + 7.0)


def test_stage_forms_and_plans_are_accepted():
    prof, c = _setup()
    a = evaluate(prof, c, [(0, 2, [0, 1]), (2, 4, [2, 3])], 32, 8)
    b = evaluate(prof, c, [Stage((0, 2), [0, 1]), Stage((2, 4), [2, 3])], 32, 8)
    plan = Plan(32, 8, [Stage((0, 2), [0, 1]), Stage((2, 4), [2, 3])])
    assert a.latency_ms == b.latency_ms == evaluate(prof, c, plan).latency_ms
    r = evaluate(prof, c, plan, model="refined")
    assert r.details["model"] == "refined" and r.latency_ms > 0


def test_stages_get_the_time_plan_gives_them():
    """evaluate's defaults are plan()'s: the refined model with the AllReduce overlapped, whichever call prices
    the stages; the paper's formula 2 is asked for by name."""
    prof, c = _setup()
    plan = make_plan(prof, c, 32, 8, verify=0)
    est = evaluate(prof, c, [(*s.layers, s.devices) for s in plan.stages], 32, 8, warmup_policy=plan.warmup_policy)
    assert est.latency_ms == plan.estimate.latency_ms
    assert (est.details["model"], est.details["overlap"]) == ("refined", True)
    hand = Plan(32, 8, plan.stages)  # a Plan made by hand: no planning meta, the same defaults
    assert evaluate(prof, c, hand).latency_ms == plan.estimate.latency_ms
    paper = evaluate(prof, c, plan.stages, 32, 8, model="paper", overlap=False)
    assert (paper.details["model"], paper.details["overlap"]) == ("paper", False)


@pytest.mark.parametrize("stages, kw, message", [
    ([(0, 2, [0]), (3, 4, [1])], {}, r"starting at layer 2"),
    ([(0, 2, [0]), (2, 5, [1])], {}, r"evaluate: stages cover layers \[0, 5\) but the profile has 4 layers"),
    ([(0, 2, [0]), (2, 3, [1])], {}, r"cover layers \[0, 3\) but the profile has 4"),
    ([(0, 2, [0, 1]), (2, 4, [1])], {}, r"device 1 is already in stage 0"),
    ([(0, 2, [0]), (2, 4, [9])], {}, r"device 9 is not in the cluster \(ids 0..3\)"),
    ([(0, 2, [0]), (2, 4, [True])], {}, r"expected device ids >= 0, got True"),  # a flag is not a device id
    ([(0, 2.0, [0]), (2, 4, [1])], {}, r"evaluate.stages\[0\].layers: expected a non-empty range .* got \[0, 2.0\)"),
    ([(0, 4, [0, 1, 2, 3])], {"micro_batch_size": 2, "global_batch_size": 8}, r"4 replicas cannot split .* of 2"),
    ([(0, 4, [0])], {"micro_batch_size": 3}, r"not divisible by micro_batch_size 3"),
    ([(0, 4, [0])], {"model": "exact"}, r"model: expected one of"),
    ([Stage((0, 2), [0], 2), Stage((2, 4), [1])], {}, r"give warmup K_i for every stage or for none"),
    ([Stage((0, 2), [0], 1), Stage((2, 4), [1], 2)], {}, r"K_1=2 exceeds K_0=1"),
    ("0-4", {}, r"expected a non-empty list"),
])
def test_bad_input_names_the_value(stages, kw, message):
    prof, c = _setup()
    args = dict(global_batch_size=32, micro_batch_size=8)
    args.update(kw)
    with pytest.raises(ValueError, match=message):
        evaluate(prof, c, stages, **args)


def test_gpipe_holds_every_micro_batch():
    prof, c = _setup()
    est = evaluate(prof, c, [(0, 2, [0]), (2, 4, [1])], 32, 8, schedule="gpipe")
    assert [s["warmup"] for s in est.details["stages"]] == [4, 4]
    tight = cluster(2, 2, memory=4 * 1e8 * 2 + 3.5 * 16e6)  # parameters + 3 slices of stage 0: M = 4 does not fit
    with pytest.raises(ValueError, match="stage 0 does not fit"):
        evaluate(prof, tight, [(0, 2, [0]), (2, 4, [1])], 32, 8, schedule="gpipe")
    evaluate(prof, tight, [(0, 2, [0]), (2, 4, [1])], 32, 8)  # dapple: K_0 = 2 fits


def test_print_plan_shows_costs_and_estimate():
    prof, c = _setup()
    stages = [Stage((0, 2), [0, 1]), Stage((2, 4), [2, 3])]
    plan = Plan(32, 8, stages, layer_names=prof.layer_names,
                estimate=evaluate(prof, c, stages, 32, 8), meta={"model": "linear"})
    text = str(plan)
    for piece in ("[0, 2) layer0 .. layer1", "0-1 (x2)", "K_i", "F ms", "AR ms", "send ms", "mem GB",
                  "warmup Tw", "steady Ts", "ending Te", "pivot stage Q = 1", "bubble fraction", "refined model",
                  "AllReduce overlapped"):
        assert piece in text, piece


@pytest.mark.parametrize("kw", [dict(), dict(schedule="gpipe"), dict(warmup_policy="B", overlap=True),
                                dict(model="paper")])
def test_a_plan_is_evaluated_as_it_was_planned(kw):
    prof, c = _setup()
    plan = make_plan(prof, c, 32, 8, verify=0, **kw)
    again = evaluate(prof, c, plan)  # its schedule, policy, model and overlap, not evaluate's own defaults
    assert again == plan.estimate
    assert again.details["model"] == kw.get("model", "refined") and again.details["schedule"] == plan.schedule
    other = "paper" if kw.get("model", "refined") == "refined" else "refined"
    assert evaluate(prof, c, plan, model=other).details["model"] == other  # an argument still wins


@pytest.mark.parametrize("args, message", [
    (("prof.yaml", "c"), r"evaluate: profile must be a dapple Profile, got str 'prof.yaml'; load it"),
    (("p", "A"), r"evaluate: cluster must be a dapple Cluster, got str 'A'"),
])
def test_wrong_kinds_of_object_are_named(args, message):
    prof, c = _setup()
    objs = {"p": prof, "c": c}
    with pytest.raises(TypeError, match=message):
        evaluate(*(objs.get(a, a) for a in args), [(0, 4, [0])], 32, 8)
