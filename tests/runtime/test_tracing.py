"""Runtime traces on 3 ranks (gloo) with skewed clocks: the schedule's exact op order, matched transfers, one
Chrome-trace process per rank, clock offsets corrected, nothing recorded when off; `dapple show --png`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from dapple.cli import main as cli
from dapple.core.timeline import Event, from_chrome_trace, lane_of
from dapple.profiler.probe.clocks import correction
from dapple.runtime.tracing import Recorder, merge
from tests.runtime import trace_workers
from tests.runtime._spawn import run_ranks

ROOT = Path(__file__).resolve().parents[2]
DAPPLE_ORDER = {0: "F0 F1 B0 F2 B1 F3 B2 B3", 1: "F0 F1 B0 F2 B1 F3 B2 B3", 2: "F0 B0 F1 B1 F2 B2 F3 B3"}
GPIPE_ORDER = "F0 F1 F2 F3 B0 B1 B2 B3"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("traces")
    results = run_ranks(trace_workers.run_traces, 3, str(out), timeout=240)
    docs = {name: json.loads((out / f"{name}.json").read_text()) for name in ("dapple", "gpipe")}
    return results, docs, out


def _events(doc: dict) -> list[Event]:
    return from_chrome_trace(doc)


def _order(events: list[Event], rank: int, step: int | None = None) -> str:
    ops = sorted((e for e in events if e.rank == rank and e.kind in ("forward", "backward")
                  and (step is None or e.args["step"] == step)), key=lambda e: e.start)
    return " ".join(e.name for e in ops)


@pytest.mark.slow
def test_dapple_trace_has_the_schedules_op_order(run):
    _, docs, _ = run
    events = _events(docs["dapple"])
    for rank, order in DAPPLE_ORDER.items():
        assert _order(events, rank) == order, rank


@pytest.mark.slow
def test_gpipe_trace_runs_all_forwards_first_in_every_step(run):
    _, docs, _ = run
    events = _events(docs["gpipe"])
    assert docs["gpipe"]["otherData"]["steps"] == [1, 2]
    for rank in range(3):
        for step in (1, 2):
            assert _order(events, rank, step) == GPIPE_ORDER, (rank, step)


@pytest.mark.slow
def test_chrome_trace_has_one_process_per_rank_and_metadata(run):
    _, docs, _ = run
    doc = docs["dapple"]
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0 · stage 0 (1/2)", 1: "rank 1 · stage 0 (2/2)", 2: "rank 2 · stage 1"}
    assert {e["pid"] for e in doc["traceEvents"] if e["ph"] == "X"} == {0, 1, 2}
    meta = doc["otherData"]
    assert meta["stage_of_rank"] == {"0": 0, "1": 0, "2": 1} and meta["schedule"] == "dapple"
    assert meta["num_micro_batches"] == 4 and meta["steps"] == [2] and meta["plan"]["stages"][1]["devices"] == [2]


@pytest.mark.slow
def test_every_receive_matches_a_send_on_its_peer(run):
    _, docs, _ = run
    for name, doc in docs.items():
        events = _events(doc)

        def key(e: Event, me: int, peer: int) -> tuple:
            return (me, peer, e.args["step"], e.micro_batch, e.args["what"], e.args["value"], tuple(e.args["rows"]),
                    e.args["bytes"])
        sends = Counter(key(e, e.rank, e.args["peer"]) for e in events if e.kind == "send")
        recvs = Counter(key(e, e.args["peer"], e.rank) for e in events if e.kind == "recv")
        assert recvs == sends and len(recvs) > 0, name
        # stage 1 gets each micro-batch in two slices (one per stage-0 replica) and sends two gradients back
        assert sum(1 for e in events if e.rank == 2 and e.kind == "recv") == 2 * 4 * len(doc["otherData"]["steps"])
        assert all(e.args["bytes"] == 8 * 6 for e in events if e.kind in ("send", "recv"))  # 1 row x 6 float64


@pytest.mark.slow
def test_clock_offsets_are_estimated_and_corrected(run):
    results, docs, _ = run
    meta = docs["dapple"]["otherData"]["ranks"]
    for r, skew in trace_workers.SKEW.items():
        err = meta[str(r)]["clock_error_ms"]
        assert abs(meta[str(r)]["clock_offset_ms"] + skew * 1e3) <= err + 1e-3, (r, meta[str(r)])
        assert err < 100, meta[str(r)]  # half a round trip, even on a loaded machine
    local = results[1]["local_starts"]
    assert min(local) > max(results[0]["local_starts"]) + 4  # rank 1's own clock runs 5 s ahead
    events = _events(docs["dapple"])
    assert max(e.end for e in events) - min(e.start for e in events) < 2.0  # merged: one step, not seconds apart
    tol = sum(i["clock_error_ms"] for i in meta.values()) / 1e3 + 1e-6
    sends = {(e.rank, e.args["peer"], e.micro_batch, e.args["what"], tuple(e.args["rows"])): e
             for e in events if e.kind == "send"}
    for e in (e for e in events if e.kind == "recv"):  # causality on rank 0's clock: sent before received
        s = sends[(e.args["peer"], e.rank, e.micro_batch, e.args["what"], tuple(e.args["rows"]))]
        assert e.end >= s.start - tol, (e, s)


@pytest.mark.slow
def test_lanes_waits_and_allreduce(run):
    _, docs, _ = run
    events = _events(docs["dapple"])
    for rank in range(3):
        lane = sorted((e for e in events if e.rank == rank and lane_of(e) == "compute"), key=lambda e: e.start)
        for a, b in zip(lane, lane[1:]):  # one thing at a time in the compute lane
            assert b.start >= a.end - 2e-9, (a, b)
        idle = [e for e in lane if e.kind == "idle" and e.args["waiting_for"].startswith("receives")]
        for e in (e for e in events if e.rank == rank and e.kind == "recv"):  # a receive wait is idle time
            assert e.args["posted_ms_before"] >= 0
            assert any(i.start - 2e-9 <= e.start and e.end <= i.end + 2e-9 for i in idle), e
    buckets = [e for e in events if e.name.startswith("AR bucket")]
    assert sorted(e.rank for e in buckets) == [0, 1]  # stage 0's replicas sum their gradients; rank 2 has none
    assert all(lane_of(e) == "allreduce" and e.args["launched_in"] == "last backward" for e in buckets)
    for e in buckets:  # launched during the last backward
        b3 = next(b for b in events if b.rank == e.rank and b.name == "B3")
        assert b3.start <= e.start <= b3.end
    assert sorted(e.rank for e in events if e.name == "AR" and lane_of(e) == "compute") == [0, 1]


@pytest.mark.slow
def test_nothing_is_recorded_when_off(run):
    results, _, out = run
    for r in results:
        assert r["recorders_when_off"] == 0 and r["rec_when_off"] == [True, True, True]
        assert r["events_after_exit"] == 0 and r["rec_after_exit"] == [True, True, True]
        assert "trace=True" in r["save_trace_when_off"]
    assert [r["dapple"] for r in results][1:] == ["None", "None"]  # only rank 0 writes
    assert not (out / "never.json").exists()


@pytest.mark.slow
def test_show_trace_png(run, tmp_path, capsys):
    _, _, out = run
    png = tmp_path / "schedule.png"
    assert cli(["show", str(out / "dapple.json"), "--png", str(png)]) == 0
    text = capsys.readouterr().out
    assert "rank 2 · stage 1" in text and "schedule dapple" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_show_rejects_png_for_yaml_and_bad_json(tmp_path):
    plan = tmp_path / "p.yaml"
    plan.write_text("dapple_plan: 1\nglobal_batch_size: 4\nmicro_batch_size: 2\nstages:\n"
                    "  - {layers: [0, 1], devices: [0]}\n")
    with pytest.raises(SystemExit, match="p.yaml does not record the profile it was made for .* give --profile"):
        cli(["show", str(plan), "--png", str(tmp_path / "x.png")])  # a plan is drawn from its simulation
    cluster = tmp_path / "c.yaml"
    cluster.write_text("dapple_cluster: 1\nservers: 1\ndevices_per_server: 2\nintra_bandwidth: 1e9\n"
                       "inter_bandwidth: 1e9\n")
    with pytest.raises(SystemExit, match=r"--png draws a trace \(\.json\) or a plan"):
        cli(["show", str(cluster), "--png", str(tmp_path / "x.png")])
    for text, message in (("a: [1, 2", "not valid YAML"), ("- 1\n", "expected a YAML mapping with one of the headers"),
                          ("a: 1\n", "is not a dapple document"), ("dapple_plan: 9\n", "dapple_plan is 9")):
        doc = tmp_path / "d.yaml"
        doc.write_text(text)
        with pytest.raises(SystemExit, match=message):  # no traceback, not even for YAML that does not parse
            cli(["show", str(doc)])
    bad = tmp_path / "t.json"
    bad.write_text("[1, 2")
    with pytest.raises(SystemExit, match="cannot read a Chrome-trace JSON"):
        cli(["show", str(bad)])


def test_correction_interpolates_drift():
    to0 = correction([[10.0, 2.0, 1e-4], [20.0, 2.001, 1e-4]])  # the offset grows 1 ms over 10 s (100 ppm)
    assert to0(10.0) == pytest.approx(12.0) and to0(15.0) == pytest.approx(17.0005)
    assert to0(5.0) == pytest.approx(7.0) and to0(30.0) == pytest.approx(32.001)  # constant outside the syncs
    assert correction([[1.0, -0.5, 0.0]])(3.0) == pytest.approx(2.5)
    # syncs whose intervals overlap: one constant offset, the middle of their intersection
    to0 = correction([[10.0, 2.0, 3e-4], [20.0, 2.0004, 2e-4]])  # [1.9997, 2.0003] and [2.0002, 2.0006]
    assert to0(10.0) == pytest.approx(12.00025) and to0(20.0) == pytest.approx(22.00025)


def test_merge_moves_each_rank_onto_rank_0s_clock():
    rec = Recorder(rank=1)
    rec.clock = iter([100.0, 102.0]).__next__  # read by begin_step and end_step
    rec.begin_step(1)
    rec.compute("F", 0, 100.5, 101.0)
    rec.end_step()
    p1 = rec.payload({"rank": 1, "stage": 0})
    p1["syncs"] = [[100.0, -90.0, 2e-5]]
    p0 = {"rank": 0, "stage": 0, "syncs": [[10.0, 0.0, 0.0]], "steps": [1],
          "events": [["forward", "F0", 10.1, 10.4, 0, {"step": 1}]]}
    events, ranks = merge([p0, p1])
    f0 = {e.rank: e for e in events if e.name == "F0"}
    assert f0[1].start == pytest.approx(10.5) and f0[1].end == pytest.approx(11.0)
    assert f0[0].start == pytest.approx(10.1)
    assert ranks[1]["clock_offset_ms"] == pytest.approx(-90000) and ranks[1]["clock_error_ms"] == pytest.approx(0.02)
    step = next(e for e in events if e.name == "step 1")
    assert lane_of(step) == "step" and step.start == pytest.approx(10.0) and step.end == pytest.approx(12.0)


def _expected(schedule: str, m: int, k: int) -> str:
    if schedule == "gpipe":
        return " ".join([f"F{j}" for j in range(m)] + [f"B{j}" for j in range(m)])
    ops = [f"F{j}" for j in range(k)]
    for j in range(m - k):
        ops += [f"B{j}", f"F{j + k}"]
    return " ".join(ops + [f"B{j}" for j in range(m - k, m)])


@pytest.mark.parametrize("name", ["dapple", "gpipe", "hybrid"])
def test_committed_example_traces_show_their_schedule(name):
    doc = json.loads((ROOT / "docs" / f"trace_{name}.json").read_text())
    meta, events = doc["otherData"], _events(doc)
    assert (ROOT / "docs" / f"trace_{name}.png").stat().st_size > 10_000
    for r, stage in meta["stage_of_rank"].items():
        assert _order(events, int(r)) == _expected(meta["schedule"], meta["num_micro_batches"],
                                                   meta["warmup"][stage]), (name, r)


@pytest.mark.slow
def test_example_script_writes_trace_and_png(tmp_path):
    run = subprocess.run([sys.executable, "examples/trace_emulated.py", "--out", str(tmp_path), "--plans", "hybrid",
                          "--micro-batches", "4", "--ms-per-row", "0.3", "--warmup", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",  # 4 ranks: share a GPU if need be
                              "DAPPLE_SHARE_GPUS": os.environ.get("DAPPLE_SHARE_GPUS", "1")})
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads((tmp_path / "trace_hybrid.json").read_text())
    assert (tmp_path / "trace_hybrid.png").read_bytes()[:4] == b"\x89PNG"
    assert doc["otherData"]["warmup"] == [3, 2, 1] and len(_events(doc)) > 50
    for r, stage in doc["otherData"]["stage_of_rank"].items():
        assert _order(_events(doc), int(r)) == _expected("dapple", 4, [3, 2, 1][stage])


def test_a_split_backward_traces_w_ops_as_weight_gradient_backwards(tmp_path):
    """zb-h1: B3 is the input-gradient backward, W3 the weight-gradient one (kind backward, part weight), drawn in
    the Gantt chart in its own colour."""
    from dapple.planner.simulator.gantt import colour_key, draw_gantt
    rec = Recorder(rank=0)
    rec.clock = iter([0.0, 1.0]).__next__  # read by begin_step and end_step
    rec.begin_step(1)
    for kind, start in (("F", 0.1), ("B", 0.3), ("W", 0.5)):
        rec.compute(kind, 3, start, start + 0.2)
    rec.end_step()
    got = {e.name: e for e in rec.events if e.kind in ("forward", "backward")}
    assert [(n, e.kind, e.args.get("part")) for n, e in got.items()] == [
        ("F3", "forward", None), ("B3", "backward", None), ("W3", "backward", "weight")]
    assert [colour_key(e) for e in got.values()] == ["forward", "backward", "weight"]
    assert draw_gantt(rec.events, tmp_path / "zb.png").stat().st_size > 0


@pytest.mark.slow
def test_torch_profiler_shows_each_op_transfer_and_allreduce_by_name(run):
    results, _, _ = run
    for rank, r in enumerate(results):  # stage 0 (ranks 0, 1, replicated) sends activations; stage 1 sends gradients
        names = set(r["profiler_ranges"])
        assert {"F0", "F3", "B0", "B3", "AllReduce", "loss AllReduce"} <= names, (rank, names)
        sent = "act" if rank < 2 else "grad"
        assert any(n.startswith(f"send {sent} ") for n in names) and any(n.startswith("recv ") for n in names), names
