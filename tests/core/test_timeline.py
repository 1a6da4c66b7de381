"""Timelines: Chrome-trace round trip with one process per rank, and a Gantt PNG drawn from one."""

from __future__ import annotations

import json

import pytest

from dapple.core.timeline import (
    Event,
    lane_of,
    load_chrome_trace,
    save_chrome_trace,
    summarize,
    to_chrome_trace,
)
from dapple.planner.simulator.gantt import draw_gantt


def _events():
    return [Event(0, "forward", "F0", 1.000, 1.002, 0), Event(1, "recv", "recv←0", 1.002, 1.0025, 0, {"peer": 0}),
            Event(1, "forward", "F0", 1.0025, 1.0045, 0), Event(1, "backward", "B0", 1.0045, 1.0085, 0),
            Event(0, "backward", "B0", 1.009, 1.013, 0), Event(0, "allreduce", "AR", 1.013, 1.014)]


def test_chrome_trace_round_trip(tmp_path):
    path = tmp_path / "t.json"
    save_chrome_trace(_events(), path, metadata={"plan": "x"})
    doc = json.loads(path.read_text())
    pids = {e["pid"] for e in doc["traceEvents"] if e["ph"] == "X"}
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert pids == {0, 1} and names == {"rank 0", "rank 1"}
    back = load_chrome_trace(path)
    assert [(e.rank, e.name, e.micro_batch) for e in back] == sorted(
        [(e.rank, e.name, e.micro_batch) for e in _events()], key=lambda x: x[0])
    assert back[0].start == 0.0 and back[0].end == pytest.approx(0.002)


def test_bad_trace_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="traceEvents"):
        load_chrome_trace(path)


def test_gantt_png(tmp_path):
    out = draw_gantt(_events(), tmp_path / "g.png", title="two ranks")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    with pytest.raises(ValueError, match="no events"):
        draw_gantt([], tmp_path / "h.png")


def test_gantt_span_sets_a_common_time_scale(tmp_path, monkeypatch):
    from matplotlib.axes import Axes
    limits = []
    set_xlim = Axes.set_xlim
    monkeypatch.setattr(Axes, "set_xlim", lambda ax, *a, **k: (limits.append(a), set_xlim(ax, *a, **k))[1])
    draw_gantt(_events(), tmp_path / "a.png")  # the events span 14 ms
    draw_gantt(_events(), tmp_path / "b.png", span_ms=20.0)
    draw_gantt(_events(), tmp_path / "c.png", span_ms=5.0)  # never shorter than the events
    assert [round(a[1] / 1.005, 6) for a in limits if len(a) == 2 and a[0] == 0] == [14.0, 20.0, 14.0]


def test_to_chrome_trace_times_are_relative_microseconds():
    doc = to_chrome_trace(_events())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in xs) == 0 and max(e["ts"] + e["dur"] for e in xs) == pytest.approx(14000)


def test_lanes_become_threads_and_overlaps_get_their_own():
    evs = [Event(0, "backward", "B3", 0.0, 1.0, 3), Event(0, "recv", "recv←1", 0.2, 0.3, 3, {"peer": 1}),
           Event(0, "allreduce", "AR bucket 0", 0.5, 2.0, None, {"lane": "allreduce"}),
           Event(0, "allreduce", "AR bucket 1", 0.8, 1.5, None, {"lane": "allreduce"}),  # overlaps bucket 0
           Event(0, "allreduce", "AR", 1.0, 2.0), Event(0, "other", "step 1", 0.0, 2.0, None, {"lane": "step"})]
    assert [lane_of(e) for e in evs] == ["compute", "p2p", "allreduce", "allreduce", "compute", "step"]
    doc = to_chrome_trace(evs, process_names={0: "rank 0 · stage 0"})
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    tid = {e["name"]: e["tid"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert tid["B3"] == tid["AR"] and threads[(0, tid["B3"])] == "compute"
    assert threads[(0, tid["recv←1"])] == "p2p" and threads[(0, tid["step 1"])] == "step"
    assert tid["AR bucket 0"] != tid["AR bucket 1"] and threads[(0, tid["AR bucket 1"])] == "allreduce (2)"
    names = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert names == ["rank 0 · stage 0"]


def test_summarize_counts_the_compute_lane_within_steps():
    evs = _events() + [Event(0, "idle", "idle", 1.002, 1.009), Event(0, "other", "step 1", 1.0, 1.02, None,
                                                                     {"lane": "step"})]
    s = summarize(evs)
    assert s[0]["span_ms"] == pytest.approx(20) and s[0]["forward_ms"] == pytest.approx(2)
    assert s[0]["backward_ms"] == pytest.approx(4) and s[0]["idle_ms"] == pytest.approx(7)
    assert s[0]["allreduce_ms"] == pytest.approx(1) and s[0]["busy"] == pytest.approx(0.3)
    assert s[1]["span_ms"] == pytest.approx(6.5) and s[1]["forward_ms"] == pytest.approx(2)  # no step: first..last


def test_simulated_timeline_as_events():
    from dapple import Cluster
    from dapple.planner import Plan, Stage, simulate
    from dapple.planner.simulator.events import from_simulation

    from ..planner.helpers import linear_profile

    prof = linear_profile([1.0, 1.0, 1.0, 1.0], params=1e6, boundary=1e5)
    plan = Plan(global_batch_size=8, micro_batch_size=2, stages=[Stage((0, 2), [0, 1]), Stage((2, 4), [2])])
    cluster = Cluster(servers=1, devices_per_server=3, intra_bandwidth=1e9, inter_bandwidth=1e9)
    sim = simulate(plan, prof, cluster)
    events = from_simulation(sim)
    compute = [e for e in events if e.kind in ("forward", "backward", "idle", "allreduce")]
    for d in range(3):  # the compute lane of each device tiles [0, its end] without overlaps
        mine = sorted((e for e in compute if e.rank == d), key=lambda e: e.start)
        assert mine[0].start == 0.0
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))
    sends = [e for e in events if e.kind == "send"]
    recvs = [e for e in events if e.kind == "recv"]
    assert len(sends) == len(recvs) == len(sim.transfers) > 0
    assert {e.rank for e in events if e.kind == "allreduce"} == {0, 1}  # the replicated stage reduces
    assert max(e.end for e in events) * 1e3 == pytest.approx(sim.latency_ms)


def test_gantt_draws_one_bar_collection_per_row_lane_and_kind(tmp_path, monkeypatch):
    """Each broken_barh call rescales the axes: one per op made M = 128 take 34 s or more (16 devices)."""
    from matplotlib.axes import Axes
    calls = []
    broken_barh = Axes.broken_barh
    monkeypatch.setattr(Axes, "broken_barh", lambda ax, spans, *a, **k: (calls.append(list(spans)),
                                                                          broken_barh(ax, spans, *a, **k))[1])
    events = [Event(r, kind, f"{kind[0].upper()}{m}", 1 + 0.01 * (2 * m + (kind == "backward")),
                    1 + 0.01 * (2 * m + (kind == "backward")) + 0.008, m)
              for r in range(2) for m in range(40) for kind in ("forward", "backward")]
    draw_gantt(events, tmp_path / "g.png")
    assert len(calls) == 4 and sorted(len(c) for c in calls) == [40] * 4  # (2 ranks) x (forward, backward)
