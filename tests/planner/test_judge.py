"""The simulator is the judge: on instances small enough to enumerate, no plan simulates faster than dapple.plan's;
schedule="auto" and "zb-h1": it judges plans under dapple's 1F1B and zb-h1, zb-h1 where it fits."""

from __future__ import annotations

import pytest

import dapple
from dapple.core.plan import Plan, Stage
from dapple.core.schedule import CHUNKED_SCHEDULES, SPLIT_BACKWARD, warmup_counts
from dapple.planner import evaluate, simulate, tuning
from dapple.planner.baselines.exhaustive import every_plan
from dapple.planner.judge import choose_schedule, devices_of
from dapple.planner.model.cost import CostModel
from dapple.planner.model.memory import split_backward_unfit
from dapple.planner.search.exact import plan_count

from .helpers import cluster, linear_profile, small_instances


def _fastest(prof, c, g: int, sizes: list[int], overlap: bool, schedules: tuple = ("dapple",)) -> float:
    """The least simulated ms over every plan of the instance (every split x assignment x size x policy x
    schedule; a split-backward one only where it fits)."""
    sims = []
    for b in sizes:
        cm, M = CostModel(prof, c, b), g // b
        for spans, _, D in every_plan(prof, c, M, cm):
            devs = devices_of(spans, c)
            for pol in "AB":
                K = warmup_counts(len(spans), M, pol, max_in_flight=D)
                stages = [Stage((a, e), ds, k) for (a, e, _), ds, k in zip(spans, devs, K)]
                for sch in schedules:
                    if sch in SPLIT_BACKWARD and split_backward_unfit(cm, stages, M, c.device_memory):
                        continue
                    p = Plan(g, b, stages, warmup_policy=pol, schedule=sch)
                    sims.append(simulate(p, prof, c, overlap=overlap).latency_ms)
    return min(sims, default=float("inf"))


@pytest.mark.parametrize("overlap, seed", [(True, 22), (False, 23)])
def test_no_plan_simulates_faster_than_the_plan(overlap, seed):
    """On 30 random instances of 2 to 5 layers on 4 devices (1 or 2 micro-batch sizes, at most judge_every plans
    in all), every plan simulated: dapple.plan's is the fastest, but for the simulator's tie margin (a plan must be
    0.1% faster to displace the model's choice, judge.Simulations.pick). Before plan() had the simulator judge
    every plan of such instances (judge.every_candidate), its choice among the DP's plan and the seed plans
    simulated 5.1% (overlap, instance 20) and 5.4% (no overlap, instance 10) slower than the fastest."""
    checked = 0
    for i, (prof, c, g, b) in enumerate(small_instances(seed, 30, max_layers=5)):
        sizes = [b, b // 2] if i % 3 == 0 else [b]
        if sum(plan_count(prof.num_layers, c.servers, c.devices_per_server, x, None)
               for x in sizes) > tuning.TUNING.judge_every:
            sizes = [b]
        best = _fastest(prof, c, g, sizes, overlap)
        if best == float("inf"):
            continue
        checked += 1
        p = dapple.plan(prof, c, g, micro_batch_sizes=sizes, overlap=overlap)
        assert simulate(p, prof, c, overlap=overlap).latency_ms <= best * (1 + 1e-3), (i, c.name, g, sizes, p)
    assert checked >= 25


@pytest.mark.parametrize("schedule, schedules, seed", [("auto", ("dapple", "zb-h1"), 24), ("zb-h1", ("zb-h1",), 25)])
def test_the_simulator_judges_every_plan_under_the_schedules_asked_for(schedule, schedules, seed):
    """schedule="auto" simulates every plan of a small instance under dapple's 1F1B and under zb-h1 (where every
    stage holds K_0 micro-batches until their W), "zb-h1" under zb-h1 alone: on 16 random instances each, no plan
    under those schedules simulates faster than dapple.plan's (the DP itself models 1F1B only), and where none
    fits, plan() says so."""
    checked = 0
    for i, (prof, c, g, b) in enumerate(small_instances(seed, 16, max_layers=5)):
        best = _fastest(prof, c, g, [b], True, schedules)
        if best == float("inf"):  # no plan fits (under zb-h1: holding K_0 on every stage)
            with pytest.raises(ValueError, match="does not fit|no plan"):
                dapple.plan(prof, c, g, b, schedule=schedule)
            continue
        checked += 1
        p = dapple.plan(prof, c, g, b, schedule=schedule)
        # "auto" may also take a plan of two chunks per device group, where it simulates faster (test_chunked.py)
        assert p.schedule in schedules + (CHUNKED_SCHEDULES if schedule == "auto" else ()), (i, p.schedule)
        assert simulate(p, prof, c, overlap=True).latency_ms <= best * (1 + 1e-3), (i, c.name, g, b, p)
    assert checked >= 10


STAGES = [Stage((0, 2), [0], 4), Stage((2, 4), [1], 3), Stage((4, 6), [2], 2), Stage((6, 8), [3], 1)]


def test_auto_picks_zero_bubble_for_a_pipeline_and_records_why(tmp_path, monkeypatch):
    # one stage per device group: here two chunks per group simulate faster still (test_chunked.py)
    monkeypatch.setattr(tuning, "TUNING", tuning.TUNING.replace(chunked_variants=False))
    prof = linear_profile([1.0] * 8, params=2e9, boundary=1e3)  # big parameters: a pipeline beats data parallel
    c = cluster(1, 4, intra=1e10)
    plan = dapple.plan(prof, c, 64, schedule="auto", overlap=True)
    choice = plan.meta["schedule_choice"]
    assert plan.schedule == choice["chosen"] == "zb-h1" and plan.num_stages > 1
    assert choice["simulated_ms"]["zb-h1"] < choice["simulated_ms"]["dapple"]
    assert plan.estimate.latency_ms == pytest.approx(simulate(plan, prof, c).latency_ms)
    assert dapple.plan(prof, c, 64, overlap=True).schedule == "dapple"  # the default stays dapple
    plan.save(tmp_path / "p.yaml")
    assert dapple.Plan.load(tmp_path / "p.yaml").meta["schedule_choice"] == choice
    with pytest.raises(ValueError, match="schedule: expected one of .* or 'auto', got 'zb'"):
        dapple.plan(prof, c, 64, schedule="zb")


def test_zero_bubble_is_refused_where_later_stages_cannot_hold_k0():
    """Each stage holds K_0 = 4 micro-batches until their W under zb-h1: the last stage's big activations fit
    once (K_3 = 1, dapple) but not four times."""
    prof = linear_profile([1.0] * 8, saved=[1e3] * 6 + [1e8] * 2)
    cm = CostModel(prof, cluster(1, 4), 8)
    memory = 2 * cm.saved_bytes(6, 8, 1)
    chosen, record = choose_schedule(prof, cluster(1, 4, memory=memory), STAGES, 64, 8, overlap=False,
                                     optimizer_factor=4.0)
    assert chosen == "dapple" and list(record["simulated_ms"]) == ["dapple"]
    assert record["refused"]["zb-h1"].startswith("stage 3 would hold 4 micro-batches until their W")
    chosen, record = choose_schedule(prof, cluster(1, 4), STAGES, 64, 8, overlap=False, optimizer_factor=4.0)
    assert chosen == "zb-h1" and "refused" not in record


def test_a_tie_keeps_dapple():
    prof = linear_profile([1.0] * 2)
    chosen, record = choose_schedule(prof, cluster(1, 2), [Stage((0, 2), [0, 1], 1)], 16, 8, overlap=False,
                                     optimizer_factor=4.0)
    assert chosen == "dapple" and record["simulated_ms"]["dapple"] == record["simulated_ms"]["zb-h1"]


def test_the_refined_model_of_zb_h1_is_its_simulation():
    prof, c = linear_profile([1.0] * 8), cluster(1, 4)
    plan = dapple.Plan(64, 8, STAGES, schedule="zb-h1")
    est = evaluate(prof, c, plan, model="refined")
    assert est.latency_ms == pytest.approx(simulate(plan, prof, c).latency_ms)
    assert est.latency_ms < evaluate(prof, c, plan, model="refined", schedule="dapple").latency_ms
    assert est.warmup_ms > 0 and est.steady_ms > 0 and est.ending_ms > 0


def test_an_explicit_zero_bubble_plan_that_does_not_fit_is_refused(monkeypatch):
    """The last stage's activations fit once (K_3 = 1 under dapple) but not K_0 = 4 times (zb-h1). (One stage per
    device group: zb-v, whose V puts the last layers beside the first, fits here and simulates faster.)"""
    monkeypatch.setattr(tuning, "TUNING", tuning.TUNING.replace(chunked_variants=False))
    prof = linear_profile([1.0] * 8, params=2e9, boundary=1e3, saved=[1e3] * 6 + [1e9] * 2)
    c = cluster(1, 4, intra=1e10, memory=5e10)
    plan = dapple.plan(prof, c, 64, 8, overlap=True, schedule="auto")
    assert plan.schedule == "dapple" and [s.warmup for s in plan.stages] == [4, 3, 2, 1]
    assert plan.meta["schedule_choice"]["refused"]["zb-h1"].startswith("stage 3 would hold 4 micro-batches")
    with pytest.raises(ValueError, match=r"schedule='zb-h1': the plan does not fit: stage 3 would hold 4"):
        evaluate(prof, c, plan, schedule="zb-h1")
    # the memory zb-h1 reports: K_0 = 4 micro-batches held on the last stage, 80 GB against K_3 = 1's 32 GB
    big = cluster(1, 4, intra=1e10, memory=1e11)
    mem = [evaluate(prof, big, plan, schedule=s).details["stages"][3]["memory_gb"] for s in ("dapple", "zb-h1")]
    assert mem == [pytest.approx(32.0), pytest.approx(80.0)]
    # asked for by name, the simulator judges the candidates as zb-h1 plans: the fastest that fits
    zb = dapple.plan(prof, c, 64, 8, overlap=True, schedule="zb-h1")
    assert zb.schedule == "zb-h1" and zb.stages != plan.stages
    assert not split_backward_unfit(CostModel(prof, c, 8), zb.stages, 8, c.device_memory)
    assert zb.meta["simulated_ms"] == pytest.approx(simulate(zb, prof, c, overlap=True).latency_ms, rel=1e-6)
    assert "latency_lower_bound_ms" not in zb.meta and zb.meta["search_schedule"] == "dapple"
    assert "no lower bound is claimed" in str(zb)
    with pytest.raises(ValueError, match=r"schedule='zb-h1': the plan found does not fit: stage 3 would hold 4"):
        dapple.plan(prof, c, 64, 8, overlap=True, schedule="zb-h1", verify=0)  # the DP's own plan, unjudged


def test_the_judge_leaves_out_a_candidate_that_does_not_fit_and_raises_any_other_error(monkeypatch):
    """choose() prices each candidate and leaves out one that does not fit (NoFitError: no trial of it is listed);
    any other error is raised, not taken for "does not fit"."""
    from dapple.planner import judge
    from dapple.planner.model.memory import NoFitError

    prof, c = linear_profile([1.0] * 4, boundary=1e3), cluster(1, 2)
    first, second = ((0, 2, (0,)), (2, 4, (0,))), ((0, 1, (0,)), (1, 4, (0,)))
    cands = [judge.Candidate(100.0, 8, first, ("fresh", "rest")), judge.Candidate(101.0, 8, second, ("even",) * 2)]
    kw = dict(model="refined", overlap=False, schedule="dapple", warmup_policy=None, optimizer_factor=4.0, verify=2)
    assert judge.choose(prof, c, 64, cands, **kw).listed == 4  # two candidates x policies A and B
    real = judge.pipeline_costs

    def second_fails(error):
        def priced(cm, spans, *a, **k):
            if tuple(spans) == second:
                raise error
            return real(cm, spans, *a, **k)
        return priced
    monkeypatch.setattr(judge, "pipeline_costs", second_fails(NoFitError("stage 1 does not fit")))
    assert judge.choose(prof, c, 64, cands, **kw).listed == 2
    monkeypatch.setattr(judge, "pipeline_costs", second_fails(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        judge.choose(prof, c, 64, cands, **kw)
