"""Timelines of a pipeline step (simulated or measured) and their Chrome-trace (Perfetto) JSON form."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

KINDS = ("forward", "backward", "send", "recv", "allreduce", "idle", "other")


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


def to_chrome_trace(events: Iterable[Event], metadata: dict | None = None) -> dict:
    """Chrome trace format: one process per rank, complete ('X') events in microseconds from the earliest."""
    events = list(events)
    t0 = min((e.start for e in events), default=0.0)
    trace = []
    ranks = sorted({e.rank for e in events})
    for r in ranks:
        trace.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        trace.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
    for e in sorted(events, key=lambda e: (e.rank, e.start)):
        args = dict(e.args)
        if e.micro_batch is not None:
            args["micro_batch"] = e.micro_batch
        trace.append({"ph": "X", "name": e.name, "cat": e.kind, "pid": e.rank, "tid": 0,
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


def save_chrome_trace(events: Iterable[Event], path: str | Path, metadata: dict | None = None) -> None:
    Path(path).write_text(json.dumps(to_chrome_trace(events, metadata)))


def load_chrome_trace(path: str | Path) -> list[Event]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a Chrome-trace JSON: {e}") from None
    return from_chrome_trace(doc, where=str(path))
