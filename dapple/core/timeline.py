"""Timelines of a pipeline step (simulated or measured) and their Chrome-trace (Perfetto) JSON form."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

KINDS = ("forward", "backward", "send", "recv", "allreduce", "idle", "other")
# Lanes (one Chrome-trace thread each, one band per rank in a Gantt chart): send/recv go to "p2p", everything
# else to "compute" unless an event says otherwise in ``args["lane"]`` (e.g. AllReduce buckets in flight while
# the rank computes go to "allreduce", step boundaries to "step"). Events of one lane should not overlap.
LANES = ("step", "compute", "p2p", "allreduce")


def lane_of(e: "Event") -> str:
    """The lane ``e`` is drawn in: ``args["lane"]`` if given, else "p2p" for send/recv, else "compute"."""
    return e.args.get("lane") or ("p2p" if e.kind in ("send", "recv") else "compute")


@dataclass
class Event:
    """One interval on one rank: a computation, a transfer, an AllReduce or a wait. Times in seconds."""

    rank: int
    kind: str  # one of KINDS
    name: str  # "F3", "B3", "send→2", "AR", ...
    start: float
    end: float
    micro_batch: int | None = None
    args: dict = field(default_factory=dict)  # peer, bytes, stage, ...

    @property
    def duration(self) -> float:
        return self.end - self.start


def _tracks(events: list[Event]) -> dict[int, tuple[str, int]]:
    """id(event) -> (lane, sub-track): within a rank's lane, overlapping events go to further sub-tracks."""
    out: dict[int, tuple[str, int]] = {}
    ends: dict[tuple[int, str], list[float]] = {}  # (rank, lane) -> end time of each sub-track's last event
    for e in sorted(events, key=lambda e: (e.rank, e.start, -e.end)):
        lane = lane_of(e)
        tracks = ends.setdefault((e.rank, lane), [])
        k = next((i for i, end in enumerate(tracks) if end <= e.start), len(tracks))
        if k == len(tracks):
            tracks.append(e.end)
        tracks[k] = e.end
        out[id(e)] = (lane, k)
    return out


def to_chrome_trace(events: Iterable[Event], metadata: dict | None = None,
                    process_names: dict[int, str] | None = None) -> dict:
    """Chrome trace format: one process per rank (named ``process_names[rank]``, default "rank r"), one thread
    per lane (:data:`LANES`; overlapping events of a lane on further threads), complete ('X') events in
    microseconds from the earliest; ``metadata`` goes to ``otherData``."""
    events = list(events)
    t0 = min((e.start for e in events), default=0.0)
    trace = []
    names = process_names or {}
    ranks = sorted({e.rank for e in events})
    for r in ranks:
        trace.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                      "args": {"name": names.get(r, f"rank {r}")}})
        trace.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
    tracks = _tracks(events)
    lanes = list(LANES) + sorted({t[0] for t in tracks.values()} - set(LANES))
    for r, lane, k in sorted({(e.rank, *tracks[id(e)]) for e in events}):
        tid = lanes.index(lane) + len(lanes) * k
        trace.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid,
                      "args": {"name": lane if k == 0 else f"{lane} ({k + 1})"}})
        trace.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": tid,
                      "args": {"sort_index": 100 * lanes.index(lane) + k}})
    for e in sorted(events, key=lambda e: (e.rank, e.start)):
        args = dict(e.args)
        if e.micro_batch is not None:
            args["micro_batch"] = e.micro_batch
        lane, k = tracks[id(e)]
        trace.append({"ph": "X", "name": e.name, "cat": e.kind, "pid": e.rank,
                      "tid": lanes.index(lane) + len(lanes) * k,
                      "ts": round((e.start - t0) * 1e6, 3), "dur": round(e.duration * 1e6, 3), "args": args})
    doc: dict = {"traceEvents": trace, "displayTimeUnit": "ms"}
    if metadata:
        doc["otherData"] = metadata
    return doc


def from_chrome_trace(doc: dict, where: str = "trace") -> list[Event]:
    """Events back from a Chrome-trace document written by :func:`to_chrome_trace` (or by any tool that
    uses one pid per rank and 'X' events with a category among :data:`KINDS`)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{where}: expected a Chrome-trace JSON object with a 'traceEvents' list")
    out = []
    for i, ev in enumerate(doc["traceEvents"]):
        if ev.get("ph") != "X":
            continue
        try:
            args = dict(ev.get("args") or {})
            mb = args.pop("micro_batch", None)
            start = float(ev["ts"]) / 1e6
            out.append(Event(rank=int(ev["pid"]), kind=ev.get("cat", "other"), name=str(ev["name"]), start=start,
                             end=start + float(ev.get("dur", 0)) / 1e6, micro_batch=mb, args=args))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: traceEvents[{i}] is not a complete event with pid/ts/dur: {e}") from None
    return out


def save_chrome_trace(events: Iterable[Event], path: str | os.PathLike, metadata: dict | None = None,
                      process_names: dict[int, str] | None = None) -> None:
    Path(path).write_text(json.dumps(to_chrome_trace(events, metadata, process_names)))


def read_chrome_trace(path: str | os.PathLike) -> dict:
    """The JSON document of a Chrome-trace file (``traceEvents``, ``otherData``), or ValueError naming it."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a Chrome-trace JSON: {e}") from None
    return doc


def load_chrome_trace(path: str | Path) -> list[Event]:
    return from_chrome_trace(read_chrome_trace(path), where=str(path))


def process_names(doc: dict) -> dict[int, str]:
    """pid -> process name, from a Chrome-trace document's 'process_name' metadata events."""
    return {int(e["pid"]): str(e["args"]["name"]) for e in doc.get("traceEvents", [])
            if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in (e.get("args") or {})}


def summarize(events: Iterable[Event]) -> dict[int, dict[str, float]]:
    """Per rank, milliseconds of: the recorded steps (``span_ms``: the "step" events' total, else first start to
    last end), forward, backward, idle and AllReduce in the compute lane, and ``busy`` = (F + B) / span."""
    per: dict[int, dict[str, float]] = {}
    spans: dict[int, list[Event]] = {}
    for e in events:
        d = per.setdefault(e.rank, {"span_ms": 0.0, "forward_ms": 0.0, "backward_ms": 0.0, "idle_ms": 0.0,
                                    "allreduce_ms": 0.0, "first": e.start, "last": e.end})
        d["first"], d["last"] = min(d["first"], e.start), max(d["last"], e.end)
        lane = lane_of(e)
        if lane == "step":
            spans.setdefault(e.rank, []).append(e)
        elif lane == "compute" and f"{e.kind}_ms" in d:
            d[f"{e.kind}_ms"] += e.duration * 1e3
    for r, d in per.items():
        first, last = d.pop("first"), d.pop("last")
        d["span_ms"] = sum(e.duration for e in spans[r]) * 1e3 if r in spans else (last - first) * 1e3
        d["busy"] = (d["forward_ms"] + d["backward_ms"]) / d["span_ms"] if d["span_ms"] > 0 else 0.0
    return dict(sorted(per.items()))

