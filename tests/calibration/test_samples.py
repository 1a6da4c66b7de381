"""What calibration reads from a trace, on hand-made events: the runtime's time that delays the pipeline, and a
stage's slowest replica."""

from __future__ import annotations

import pytest

import dapple
from dapple.calibration import samples
from dapple.calibration.traces import TracedRun
from dapple.core.timeline import Event
from dapple.planner import Stage

MS = 1e-3


def _run(events: list[Event], stages) -> TracedRun:
    plan = dapple.Plan(8, 4, [Stage(layers, devices) for layers, devices in stages])
    return TracedRun(plan, events, "hand-made", [1])


def _op(rank: int, name: str, start: float, end: float) -> Event:
    kind = "forward" if name[0] == "F" else "backward"
    return Event(rank, kind, name, start * MS, end * MS, int(name[1:]), {"step": 1})


def test_the_runtimes_time_before_an_op_and_until_its_sends_are_posted_counts_not_before_a_wait():
    events = [
        _op(0, "F0", 0.0, 1.0),
        Event(0, "send", "send→1", 1.0 * MS, 1.2 * MS, 0, {"step": 1}),
        _op(0, "F1", 1.5, 2.5),  # 0.5 ms before it: the op could have started
        Event(0, "send", "send→1", 2.5 * MS, 2.8 * MS, 1, {"step": 1}),  # 0.3 ms: its message left that late
        Event(0, "idle", "idle", 3.0 * MS, 4.0 * MS, None, {"step": 1}),  # 0.2 ms before a wait: nothing delayed
        _op(0, "B1", 4.1, 5.0),  # 0.1 ms
        _op(0, "B0", 5.0, 6.0),
    ]
    gaps = samples.gaps_per_op(_run(events, [((0, 1), [0]), ((1, 2), [1])]))
    assert gaps == pytest.approx([(0.5 + 0.3 + 0.1) / 4])


def test_a_stage_runs_at_its_slowest_replicas_pace_all_kinds_of_one_replica_together():
    # replica 0: slow forwards, fast backwards; replica 1 the other way round; replica 1 is slower in all
    events = [_op(0, "F0", 0, 3), _op(0, "B0", 3, 5), _op(1, "F0", 0, 2), _op(1, "B0", 2, 6.5)]
    modelled = {(d, k): v for d in (0, 1) for k, v in (("F", 2.0), ("B", 4.0))}
    ratios = samples.op_ratios(_run(events, [((0, 2), [0, 1])]), modelled)
    assert {r.kind: r.ratio for r in ratios} == pytest.approx({"F": 1.0, "B": 4.5 / 4})  # replica 1's (not F 1.5)
