"""The Autotuner on 4 ranks (gloo, float64, emulated layers, windows of 4 steps): as profiled it stays; once the
layers of one stage slow down 3x, calibration finds the added time, the tuner moves those layers apart and keeps
the faster plan; a forced switch to a bad plan is measured slower and rolled back; every loss is one process's."""

from __future__ import annotations

import pytest

from dapple import Decision
from tests import autotune_workers as w
from tests.runtime._spawn import run_ranks


@pytest.fixture(scope="module")
def results():
    return run_ranks(w.run, 4, timeout=280)


def _history(results) -> list[Decision]:
    return results[0]["history"]


@pytest.mark.slow
def test_every_rank_takes_the_same_decisions_stay_switch_keep_trial_rollback(results):
    assert [d.action for d in _history(results)] == ["stay", "switch", "keep", "trial", "rollback"]
    for r in results[1:]:
        assert [(d.action, d.candidate) for d in r["history"]] == [(d.action, d.candidate) for d in _history(results)]
    assert all(d.switch_seconds > 0 for d in _history(results) if d.action in ("switch", "trial", "rollback"))


@pytest.mark.slow
def test_calibration_recovers_the_injected_slowdown_within_25_percent(results):
    slow = results[0]["slow"]
    first = results[0]["plans"][0]
    stage = next(i for i, (layers, _) in enumerate(first) if list(range(*layers)) == slow)
    before, after = (_history(results)[k].calibration["stages"] for k in (0, 1))
    profiled = {"F": w.MS * len(slow), "B": 2 * w.MS * len(slow)}  # ms of the slowed stage's op, one row
    for kind, ms in profiled.items():
        scale = [next(s["scale"] for s in stages if s["stage"] == stage and s["kind"] == kind)
                 for stages in (before, after)]
        added = (scale[1] - scale[0]) * ms  # the op's calibrated time grew by the holds' added time
        # (4 ranks on 2 cores beside other tests: 12% and 32% off under load, within 10% in quieter runs)
        assert added == pytest.approx((w.FACTOR - 1) * ms, rel=0.25), (kind, scale)


@pytest.mark.slow
def test_the_slowed_layers_are_moved_apart_and_the_step_gets_faster(results):
    slow = results[0]["slow"]
    first, after_switch = results[0]["plans"][0], results[0]["plans"][2]

    def slow_per_stage(plan):
        return max(sum(1 for i in slow if a <= i < c) for (a, c), _ in plan)
    assert slow_per_stage(first) == 2 and slow_per_stage(after_switch) == 1
    switch, keep = _history(results)[1:3]
    assert switch.estimate_ms < 0.9 * switch.measured_ms
    assert keep.measured_ms < 0.8 * switch.measured_ms and keep.before_ms == switch.measured_ms


@pytest.mark.slow
def test_a_forced_bad_switch_is_rolled_back(results):
    trial, rollback = _history(results)[3:5]
    assert trial.candidate.startswith("0-4@0") and rollback.plan == trial.candidate
    assert rollback.measured_ms > rollback.before_ms == trial.measured_ms
    assert rollback.candidate == trial.plan and results[0]["plans"][-1] == results[0]["plans"][2]
    assert "slower" in str(rollback) and f"{rollback.measured_ms:.1f} ms" in str(rollback)


@pytest.mark.slow
def test_training_through_three_switches_is_one_process_training(results):
    for r in results:
        assert r["losses"] == pytest.approx(r["one_process"], rel=1e-12, abs=1e-14)


def test_bad_settings_are_named_before_anything_runs():
    from dapple import Autotuner
    with pytest.raises(ValueError, match="every must be an integer >= skip \\+ 2 = 3"):
        Autotuner(None, None, None, every=2)
    with pytest.raises(ValueError, match="margin must be a share in \\[0, 1\\), got 1.5"):
        Autotuner(None, None, None, margin=1.5)


def test_a_decision_reads_with_its_figures():
    d = Decision(step=40, action="rollback", measured_ms=120.5, plan="0-4@0K4 b1 dapple", candidate="0-2@0K7 b1 dapple",
                 before_ms=100.25, switch_seconds=0.5, reason="the new plan measured slower than the one before")
    assert str(d) == ("step 40: rollback: the new plan measured slower than the one before; measured 120.5 ms on "
                      "0-4@0K4 b1 dapple, candidate 0-2@0K7 b1 dapple, before the switch 100.2 ms, switch took 0.50 s")
