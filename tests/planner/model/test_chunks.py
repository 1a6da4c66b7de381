"""Memory of devices holding several chunks (every chunk's parameters and activations in flight), and evaluate() of
plans of chunks (simulated, K_i from the order)."""

from __future__ import annotations

import pytest

from dapple import Plan
from dapple.core.chunk_schedule import peak_held
from dapple.planner import NoFitError, Stage, evaluate, simulate
from dapple.planner.model.chunks import chunked_unfit, group_bytes, stage_memory
from dapple.planner.model.cost import CostModel

from ..helpers import cluster, linear_profile

# 1e8 parameter bytes per layer (x4: 0.4 GB static), 1e6 saved bytes per row (8 MB per slice of 8 rows)
PROF = linear_profile([1.0] * 4, params=1e8, saved=1e6)


def _v_plan(schedule: str = "zb-v", M: int = 4) -> Plan:
    order = [0, 1, 1, 0] if schedule == "zb-v" else [0, 1, 0, 1]
    return Plan(M * 8, 8, [Stage((i, i + 1), [order[i]]) for i in range(4)], schedule=schedule)


@pytest.mark.parametrize("schedule, stages", [("zb-v", [0, 3]), ("interleaved-1f1b", [0, 2])])
def test_a_device_holds_every_chunks_parameters_and_activations(schedule, stages):
    plan = _v_plan(schedule, M=8)
    cm = CostModel(PROF, cluster(1, 2), 8)
    gb = group_bytes(cm, plan.stages, plan.num_micro_batches, schedule)[0]
    assert gb.stages == stages and gb.devices == [0]
    assert gb.static == pytest.approx(2 * 4e8)
    held = peak_held(plan.rank_ops(0))  # micro-batches in flight on the device, all chunks
    alone = peak_held([op for op in plan.rank_ops(0) if op.stage == stages[0]])
    assert held >= alone  # its first chunk's and the other's
    assert gb.activations == pytest.approx(held * 8e6)
    assert stage_memory(cm, plan.stages, 8, schedule)[stages[1]] == pytest.approx(gb.peak)


def test_evaluate_prices_a_plan_of_chunks_by_simulating_it():
    plan = _v_plan()
    c = cluster(1, 2)
    est = evaluate(PROF, c, plan)
    assert est.latency_ms == pytest.approx(simulate(plan, PROF, c, overlap=False).latency_ms)
    cm = CostModel(PROF, c, 8)
    mem = stage_memory(cm, plan.stages, 4, "zb-v")
    assert [s["memory_gb"] for s in est.details["stages"]] == [round(m / 1e9, 4) for m in mem]
    assert [s["warmup"] for s in est.details["stages"]] == plan.warmup  # the order's K_i
    same = evaluate(PROF, c, [Stage(s.layers, s.devices) for s in plan.stages], 32, 8, schedule="zb-v")
    assert same.latency_ms == est.latency_ms


def test_a_plan_of_chunks_that_does_not_fit_names_the_devices_and_chunks():
    plan = _v_plan()
    cm = CostModel(PROF, cluster(1, 2), 8)
    need = group_bytes(cm, plan.stages, 4, "zb-v")[0].peak
    assert chunked_unfit(cm, plan.stages, 4, "zb-v", need) == ""
    why = chunked_unfit(cm, plan.stages, 4, "zb-v", need - 1)
    assert "devices [0] (stages [0, 3])" in why and "every chunk's activations in flight" in why
    with pytest.raises(NoFitError, match=r"devices \[0\] \(stages \[0, 3\]\)"):
        evaluate(PROF, cluster(1, 2, memory=need - 1), plan)


def test_formula_2_does_not_price_chunks():
    with pytest.raises(ValueError, match="model='refined'"):
        evaluate(PROF, cluster(1, 2), _v_plan(), model="paper")
