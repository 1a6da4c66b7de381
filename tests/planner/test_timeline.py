"""Timelines: Chrome-trace round trip with one process per rank, and a Gantt PNG drawn from one."""

from __future__ import annotations

import json

import pytest

from dapple.planner.gantt import draw_gantt
from dapple.planner.timeline import Event, load_chrome_trace, save_chrome_trace, to_chrome_trace


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


def test_to_chrome_trace_times_are_relative_microseconds():
    doc = to_chrome_trace(_events())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in xs) == 0 and max(e["ts"] + e["dur"] for e in xs) == pytest.approx(14000)
