"""Gantt chart of a pipeline timeline (ranks x time), as the paper's Fig. 3/4, drawn headless with matplotlib."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from ...core.timeline import Event, lane_of
from .events import SimResult, from_simulation, simulate

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.plan import Plan
    from ...core.profile import Profile

COLOURS = {"forward": "#4C72B0", "backward": "#55A868", "weight": "#A6D8B0", "send": "#DD8452", "recv": "#C9A227",
           "allreduce": "#C44E52", "idle": "#DDDDDD", "other": "#8172B3"}
LEGEND = {"forward": "forward", "backward": "backward", "weight": "weight gradients (W)", "idle": "idle (waiting)",
          "allreduce": "AllReduce", "send": "send", "recv": "recv (wait)", "other": "other"}
COMM = ("send", "recv")  # kinds drawn in the thin transfer lane (with AllReduce buckets in flight, lane_of)
ROW = 1.0  # height of one rank's row: compute band on top, transfer band below
COMPUTE = (-0.05, 0.5)  # (bottom offset from the row's centre, height)
TRANSFER = (-0.42, 0.27)
CHAR_WIDTH = 0.0058  # width of one label character, as a fraction of the axis (fontsize 7, 12 in wide)


def colour_key(e: Event) -> str:
    """The COLOURS key of ``e``: its kind, or "weight" for a split backward's W (kind "backward")."""
    return "weight" if e.kind == "backward" and e.args.get("part") == "weight" else e.kind


def _label(e: Event) -> str | None:
    if e.kind in ("forward", "backward") and e.micro_batch is not None:
        return str(e.micro_batch)
    if e.kind == "allreduce" and lane_of(e) == "compute":
        return "AR"
    return None


def draw_gantt(events: Iterable[Event], path: str | Path, title: str = "", rank_labels: dict | None = None,
               span_ms: float | None = None) -> Path:
    """Draw ``events`` to a PNG: one row per rank, computation on top, transfers in a thin lane below.

    Forward blue, backward green (as in the paper; a split backward's W pale green), idle grey hatched, AllReduce
    red; in the transfer lane
    sends orange, receive waits yellow and AllReduce buckets in flight red (events too short to see are drawn
    a hair wide, so every transfer shows). Micro-batch ids are written in the cells wide enough to hold them;
    with several steps, dashed lines mark where each starts.

    Args:
        events: the timeline (a measured trace, or :func:`events.from_simulation`).
        path: the PNG to write.
        title: drawn above the chart.
        rank_labels: rank -> its row's label (default "rank r").
        span_ms: the time axis length (at least the events'), so two charts drawn with the same value share a
            scale.

    Returns:
        ``path``, as a Path.
    """
    import matplotlib  # (heavy: loaded only when a chart is drawn)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = list(events)
    drawn = [e for e in events if e.end > e.start and lane_of(e) != "step"]
    if not drawn:
        raise ValueError("draw_gantt: no events with a positive duration to draw")
    t0 = min(e.start for e in drawn)
    span_ms = max((max(e.end for e in drawn) - t0) * 1e3, span_ms or 0.0)
    ranks = sorted({e.rank for e in drawn})
    row = {r: len(ranks) - 1 - i for i, r in enumerate(ranks)}  # rank 0 on top
    fig, ax = plt.subplots(figsize=(12, 1.1 + 0.62 * len(ranks)), dpi=120)
    _draw_bars(ax, _bars(ax, drawn, row, t0, span_ms))
    for s in _first_per_step(events):
        ax.axvline((s - t0) * 1e3, color="#888888", linestyle="--", linewidth=0.8, zorder=0)
    _axes(ax, ranks, row, rank_labels or {}, span_ms, drawn, title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def _bars(ax, drawn: list[Event], row: dict, t0: float, span_ms: float) -> dict[tuple, list[tuple[float, float]]]:
    """The events' (x, width) ms grouped by (phase, bottom, height, colour, idle, thin): one broken_barh call
    each (each call rescales the axes); writes the micro-batch ids in the cells wide enough."""
    hair = span_ms / 900  # the narrowest a transfer is drawn
    bars: dict[tuple, list[tuple[float, float]]] = {}
    for e in sorted(drawn, key=lambda e: (lane_of(e) != "allreduce", e.start)):
        thin = lane_of(e) != "compute"
        off, height = TRANSFER if thin else COMPUTE
        lo = row[e.rank] * ROW + off
        x, w = (e.start - t0) * 1e3, e.duration * 1e3
        colour = COLOURS.get(colour_key(e), COLOURS["other"])
        bars.setdefault((lane_of(e) != "allreduce", lo, height, colour, e.kind == "idle", thin), []).append(
            (x, max(w, hair) if thin and e.kind != "idle" else w))
        text = None if thin else _label(e)
        if text and w >= span_ms * (CHAR_WIDTH * len(text) + 0.004):
            ax.text(x + w / 2, lo + height / 2, text, ha="center", va="center", fontsize=7, color="white",
                    fontweight="bold")
    return bars


def _draw_bars(ax, bars: dict[tuple, list[tuple[float, float]]]) -> None:
    """AllReduce buckets in flight first, under the transfers; idle hatched."""
    for (_, lo, height, colour, idle, thin), spans in sorted(bars.items(), key=lambda kv: kv[0][0]):
        if idle:
            ax.broken_barh(spans, (lo, height), facecolors=colour, edgecolor="#BBBBBB", linewidth=0, hatch="///")
        else:
            ax.broken_barh(spans, (lo, height), facecolors=colour, edgecolor="white" if not thin else "none",
                           linewidth=0.5)


def _axes(ax, ranks: list, row: dict, labels: dict, span_ms: float, drawn: list[Event], title: str) -> None:
    """Rank labels, the time axis, the legend of the kinds drawn, and the title."""
    from matplotlib.patches import (
        Patch,  # (with matplotlib itself, only when a chart is drawn)
    )

    ax.set_yticks([row[r] * ROW + COMPUTE[0] + COMPUTE[1] / 2 for r in ranks])
    ax.set_yticklabels([labels.get(r, f"rank {r}") for r in ranks], fontsize=9)
    ax.set_ylim(-0.55, (len(ranks) - 1) * ROW + 0.55)
    ax.set_xlim(0, span_ms * 1.005)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", alpha=0.3)
    kinds = [k for k in COLOURS if any(colour_key(e) == k for e in drawn)]
    handles = [Patch(facecolor=COLOURS[k], label=LEGEND[k], hatch="///" if k == "idle" else None,
                     edgecolor="#BBBBBB" if k == "idle" else COLOURS[k]) for k in kinds]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(kinds), fontsize=8,
              frameon=False, handlelength=1.5, columnspacing=1.2)
    if title:
        ax.set_title(title, fontsize=10, loc="left", pad=18 if len(title) > 50 else 6)


def _first_per_step(events: list[Event]) -> list[float]:
    """Start of each step after the first (earliest over ranks), from the "step" lane's events."""
    first: dict[object, float] = {}
    for e in events:
        if lane_of(e) == "step":
            key = e.args.get("step", e.name)
            first[key] = min(first.get(key, e.start), e.start)
    return sorted(first.values())[1:]


def draw_plan(plan: "Plan", profile: "Profile", cluster: "Cluster", path: str | Path, *, overlap: bool | None = None,
              title: str | None = None) -> "SimResult":
    """Simulate ``plan`` on ``profile`` and ``cluster`` and draw its schedule to a PNG like a measured trace
    (one row per device).

    Args:
        plan, profile, cluster: as :func:`simulate`.
        path: the PNG to write.
        overlap: as :func:`simulate` (default: as the plan was made).
        title: drawn above the chart (default: the schedule, its stages and micro-batches, the latency).

    Returns:
        The simulation (its ``latency_ms``, timeline, ...).
    """
    sim = simulate(plan, profile, cluster, overlap=overlap)
    if title is None:
        title = (f"{plan.schedule} schedule, simulated: {plan.num_stages} stage{'s' if plan.num_stages != 1 else ''}"
                 f", M={plan.num_micro_batches} micro-batches of {plan.micro_batch_size} rows, "
                 f"{sim.latency_ms:.1f} ms")
    draw_gantt(from_simulation(sim), path, title=title, rank_labels=device_labels(sim))
    return sim


def device_labels(sim: "SimResult") -> dict[int, str]:
    """Row labels of a simulated timeline: "device d · stage s" (several chunks: "stages s, t")."""
    chunks = sim.stages_of_device
    return {d: (f"device {d} · stages {', '.join(map(str, chunks[d]))}" if len(chunks.get(d, ())) > 1
                else f"device {d} · stage {s}") for d, s in sim.stage_of_device.items()}
