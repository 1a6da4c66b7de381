"""Gantt chart of a pipeline timeline (ranks x time), as the paper's Fig. 3/4, drawn headless with matplotlib."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from .timeline import Event

COLOURS = {"forward": "#4C72B0", "backward": "#55A868", "send": "#DD8452", "recv": "#C9A227",
           "allreduce": "#C44E52", "idle": "#DDDDDD", "other": "#8172B3"}
COMM = ("send", "recv")


def draw_gantt(events: Iterable[Event], path: str | Path, title: str = "", rank_labels: dict | None = None) -> Path:
    """Draw ``events`` to a PNG: one row per rank, computation on top, transfers in a thin lane below.

    Forward blue, backward green (as in the paper), send orange, recv yellow, AllReduce red, idle grey;
    micro-batch ids are written in cells wide enough to hold them.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = [e for e in events if e.end > e.start]
    if not events:
        raise ValueError("draw_gantt: no events with a positive duration to draw")
    t0 = min(e.start for e in events)
    span_ms = (max(e.end for e in events) - t0) * 1e3
    ranks = sorted({e.rank for e in events})
    row = {r: i for i, r in enumerate(ranks)}
    fig_h = 1.2 + 0.55 * len(ranks)
    fig, ax = plt.subplots(figsize=(12, fig_h), dpi=120)
    min_label = span_ms / 60  # a cell narrower than this gets no text
    for e in events:
        y = len(ranks) - 1 - row[e.rank]
        comm = e.kind in COMM
        lo, height = (y - 0.42, 0.22) if comm else (y - 0.16, 0.54)
        x, w = (e.start - t0) * 1e3, e.duration * 1e3
        ax.broken_barh([(x, w)], (lo, height), facecolors=COLOURS.get(e.kind, COLOURS["other"]),
                       edgecolor="white", linewidth=0.4, hatch="//" if e.kind == "idle" else None)
        if not comm and e.kind in ("forward", "backward") and e.micro_batch is not None and w >= min_label:
            ax.text(x + w / 2, lo + height / 2, str(e.micro_batch), ha="center", va="center", fontsize=7,
                    color="white")
        elif e.kind == "allreduce" and w >= min_label:
            ax.text(x + w / 2, lo + height / 2, "AR", ha="center", va="center", fontsize=7, color="white")
    labels = rank_labels or {}
    ax.set_yticks([len(ranks) - 1 - row[r] for r in ranks])
    ax.set_yticklabels([labels.get(r, f"rank {r}") for r in ranks])
    ax.set_ylim(-0.6, len(ranks) - 0.4)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", alpha=0.3)
    kinds = [k for k in COLOURS if any(e.kind == k for e in events)]
    ax.legend(handles=[Patch(color=COLOURS[k], label=k) for k in kinds], loc="lower right",
              bbox_to_anchor=(1.0, 1.0), ncol=len(kinds), fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
