"""Fits: compute scales per stage and kind, a link's latency and bandwidth, an AllReduce's factor on the ring model."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

from .samples import OpRatio, Reduction, Transfer

SPREAD = 1.5  # sizes this far apart (largest / smallest) fit a line; closer ones only scale the model
FACTOR_RANGE = (1e-3, 1e3)  # the AllReduce factor is looked for in here


@dataclass(frozen=True)
class Scale:
    """Measured over modelled time of one stage's ops of one kind: the median over steps."""

    stage: int
    kind: str
    scale: float
    ops: int  # ops measured, over all steps
    steps: int


@dataclass(frozen=True)
class LinkFit:
    """A link class's ``latency`` (s) and ``bandwidth`` (B/s) after the fit, and how they were found."""

    latency: float
    bandwidth: float
    samples: int
    method: str  # "least squares", "scaled" (one size: the model's shape, scaled), "unchanged" (no samples)
    measured_s: float | None = None  # median seconds of the samples
    modelled_s: float | None = None  # what the documents modelled for them before the fit (median)


def scales(ratios: Sequence[OpRatio]) -> list[Scale]:
    """Per (stage, kind): the median over steps of the step's ratio."""
    per: dict[tuple[int, str], list[OpRatio]] = {}
    for r in ratios:
        per.setdefault((r.stage, r.kind), []).append(r)
    return [Scale(s, k, statistics.median(r.ratio for r in rs), sum(r.ops for r in rs), len(rs))
            for (s, k), rs in sorted(per.items())]


def fit_link(samples: Sequence[Transfer], latency: float, bandwidth: float) -> LinkFit:
    """``seconds = latency + bytes / bandwidth`` through the samples' median seconds per size, by least squares
    when their sizes spread (a slope of zero or less, noise, falls back to scaling); with one size, the model's
    latency and 1 / bandwidth both scaled by measured / modelled (the one point fixes only their sum)."""
    if not samples:
        return LinkFit(latency, bandwidth, 0, "unchanged")
    sizes: dict[float, list[float]] = {}
    for t in samples:
        sizes.setdefault(t.nbytes, []).append(t.seconds)
    xs = sorted(sizes)
    ys = [statistics.median(sizes[x]) for x in xs]
    ws = [len(sizes[x]) for x in xs]
    measured = statistics.median(t.seconds for t in samples)
    modelled = statistics.median(latency + t.nbytes / bandwidth for t in samples)
    if len(xs) > 1 and xs[0] > 0 and xs[-1] / xs[0] >= SPREAD:
        slope, intercept = _weighted_line(xs, ys, ws)
        if slope > 0:
            return LinkFit(max(0.0, intercept), 1.0 / slope, len(samples), "least squares", measured, modelled)
    k = measured / modelled if modelled > 0 else 1.0
    return LinkFit(latency * k, bandwidth / k, len(samples), "scaled", measured, modelled)


def _weighted_line(xs: Sequence[float], ys: Sequence[float], ws: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of the weighted least-squares line through (xs, ys)."""
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys))
    slope = sxy / sxx if sxx > 0 else 0.0
    return slope, my - slope * mx


def chain_tail(r: Reduction, ring_s: Callable[[float], float], factor: float) -> float:
    """Seconds from the last bucket's launch to the end of the AllReduce, buckets run one after another, each
    started at its measured launch (or when the one before ends), each taking ``factor`` x the ring model."""
    end = -math.inf
    for nbytes, launched in r.buckets:
        end = max(end, launched) + factor * ring_s(nbytes)
    return end - r.buckets[-1][1]


def allreduce_factor(samples: Sequence[tuple[Reduction, Callable[[float], float]]]) -> float | None:
    """The factor on the ring model's time that makes the modelled chain of buckets end when the measured one did:
    the median over samples (each with its group's ring model, bytes -> s) of each sample's factor (bisection: the
    tail grows with the factor); None without samples."""
    found = []
    for r, ring_s in samples:
        measured = r.done - r.buckets[-1][1]
        if measured <= 0 or ring_s(r.buckets[-1][0]) <= 0:
            continue
        lo, hi = FACTOR_RANGE
        for _ in range(60):  # on a log scale: 1e-3 .. 1e3 to well under 0.1%
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if chain_tail(r, ring_s, mid) < measured else (lo, mid)
        found.append(math.sqrt(lo * hi))
    return statistics.median(found) if found else None
