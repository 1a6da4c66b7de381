"""Measured runs as calibration reads them: each trace's events on one clock, the plan it ran, its step lengths."""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence, cast

from ..core.plan import Plan
from ..core.timeline import Event, from_chrome_trace, lane_of, read_chrome_trace

TraceLike = Any  # a Chrome-trace path, its JSON document, or (events, meta) as ``Trace.gather()`` returns


@dataclass
class TracedRun:
    """The measured steps of one plan: every rank's events on one clock and the plan that ran them."""

    plan: Plan
    events: list[Event]
    source: str  # the file it was read from, or "gathered"
    steps: list[int] = field(default_factory=list)  # the step numbers kept

    def step_ms(self) -> dict[int, float]:
        """Per step: ms from its earliest start to its latest end over every rank's ``train_step`` span (the
        "step" lane), the time the planner's estimate models."""
        spans: dict[int, list[Event]] = {}
        for e in self.events:
            if lane_of(e) == "step":  # every event kept holds its step (_read keeps those only)
                spans.setdefault(cast(int, e.args.get("step")), []).append(e)
        return {s: (max(e.end for e in es) - min(e.start for e in es)) * 1e3 for s, es in sorted(spans.items())}

    def median_step_ms(self) -> float:
        """The median of :meth:`step_ms`."""
        lengths = list(self.step_ms().values())
        if not lengths:
            raise ValueError(f"{self.source}: the trace holds no step spans (was it recorded by dapple's runtime?)")
        return statistics.median(lengths)


def traced_runs(traces: TraceLike | Sequence[TraceLike], skip: int = 0) -> list[TracedRun]:
    """``traces`` as TracedRuns: one trace or a list of them, each a Chrome-trace file written by ``Trace.save`` or
    ``Pipeline.save_trace``, its JSON document, or the ``(events, meta)`` pair ``Trace.gather()`` returns on rank 0.

    Args:
        traces: what to read.
        skip: drop each trace's first ``skip`` steps (e.g. the first step after a switch of plan).

    Raises:
        ValueError: naming the trace, if it holds no plan (not written by dapple's runtime) or no steps left.
    """
    items = [traces] if _is_one(traces) else list(traces)
    if not items:
        raise ValueError("calibrate: expected at least one trace, got none")
    return [_read(t, i, skip) for i, t in enumerate(items)]


def _is_one(traces: Any) -> bool:
    if isinstance(traces, (str, os.PathLike, dict)):
        return True
    return (isinstance(traces, tuple) and len(traces) == 2 and isinstance(traces[1], dict)
            and isinstance(traces[0], list) and all(isinstance(e, Event) for e in traces[0]))


def _read(trace: TraceLike, i: int, skip: int) -> TracedRun:
    if isinstance(trace, (str, os.PathLike)):
        doc, source = read_chrome_trace(trace), str(Path(trace))
        events, meta = from_chrome_trace(doc, where=source), doc.get("otherData") or {}
    elif isinstance(trace, dict):
        source = f"traces[{i}]"
        events, meta = from_chrome_trace(trace, where=source), trace.get("otherData") or {}
    elif isinstance(trace, tuple) and len(trace) == 2:
        (events, meta), source = trace, f"traces[{i}] (gathered)"
    else:
        raise ValueError(f"calibrate: traces[{i}]: expected a Chrome-trace path, its JSON document or the "
                         f"(events, meta) of Trace.gather(), got {type(trace).__name__}")
    if not isinstance(meta, dict) or "plan" not in meta:
        raise ValueError(f"calibrate: {source} holds no plan in its metadata (otherData.plan): only traces recorded "
                         f"by dapple's runtime (pipe.trace(), trace=True) can be calibrated against")
    plan = Plan.from_dict(meta["plan"], where=f"{source}: otherData.plan")
    steps = sorted({s for s in (e.args.get("step") for e in events) if s is not None})
    kept = set(steps[skip:])
    if not kept:
        raise ValueError(f"calibrate: {source} holds {len(steps)} step(s); none left after skipping {skip}")
    return TracedRun(plan, [e for e in events if e.args.get("step") in kept], source, sorted(kept))


def by_step(events: Iterable[Event]) -> dict[Any, list[Event]]:
    """Events grouped by their ``args["step"]``."""
    out: dict[Any, list[Event]] = {}
    for e in events:
        out.setdefault(e.args.get("step"), []).append(e)
    return out
