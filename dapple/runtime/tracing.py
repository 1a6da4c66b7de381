"""Opt-in timeline of training steps: per-rank events (F/B, transfer waits, AllReduce, idle) merged over ranks."""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from ..core.plan import Plan
from ..core.timeline import Event, save_chrome_trace
from ..profiler.probe.clocks import ClockSync, constant_offset, correction, gather_json, sync_clock
from .distributed import DistContext
from .gpu_clock import EventClock
from .program import Transfer

CLOCK: Callable[[], float] = time.perf_counter  # read when a Recorder is made (tests skew it per rank)
KEEP_STEPS = 16  # pipeline(trace=True) keeps this many most recent steps
ARROW = {"send": "→", "recv": "←"}


class Recorder:
    """This rank's events of the steps it records, on its own clock; called by the engine only when tracing.

    The engine holds a Recorder only while tracing (otherwise each instruction costs one ``is None`` test). The
    hot path appends a plain tuple per event (no formatting); :attr:`events` builds the ``Event`` objects.
    Times are read from :data:`CLOCK`; on CUDA each read records an event on the stream instead
    (:class:`~dapple.runtime.gpu_clock.EventClock`), resolved at the step's end, so a time is when the GPU finished
    the work before it, not when the host queued it, and tracing adds no host sync per event. A step records, per
    rank (kinds and names as in :mod:`dapple.core.timeline`):

    - compute lane: ``F3``/``B3`` (forward/backward of micro-batch 3, receives already waited for; under a split
      backward B3 computes input gradients and ``W3``, kind "backward" with ``args["part"] = "weight"``, the
      weight gradients); ``idle``
      (waiting for an op's receives, for sends to complete, or for the loss AllReduce; ``args["waiting_for"]``
      says which); ``AR`` (waiting for the stage's gradient AllReduce).
    - p2p lane: ``recv←1`` from the start to the end of the wait for that message (``args["posted_ms_before"]``:
      how long before the wait its irecv was posted); ``send→2`` the isend call. Both with peer, bytes,
      micro-batch.
    - allreduce lane: ``AR bucket k`` from the launch of bucket k to when the rank saw it complete.
    - step lane: ``step n``, the whole ``train_step`` call.
    """

    def __init__(self, rank: int, max_steps: int | None = None,
                 value_name: Callable[[Transfer], str] = lambda t: f"value {t.value}", device: Any = None):
        self.clock: Callable[[], Any] = CLOCK  # a time, or on CUDA a Stamp resolved at the step's end
        self.base_clock = CLOCK  # the same time base, read at once
        self._gpu: EventClock | None = None
        if device is not None and torch.device(device).type == "cuda":  # kernels and NCCL run asynchronously:
            self.clock = self._gpu = EventClock(torch.device(device), CLOCK)  # times of the GPU's work, no stalls
        self.rank = rank
        self.value_name = value_name  # boundary value -> its name in the model's graph
        self.steps: deque[tuple[int, list[tuple]]] = deque(maxlen=max_steps)  # (step, its raw events)
        self.syncs: list[ClockSync] = []
        self.posted: dict[Transfer, float] = {}  # irecv post times of the current step
        self._raw: list[tuple] = []
        self._step = 0
        self._step_start = 0.0

    @property
    def events(self) -> list[Event]:
        """Every recorded event (this rank's clock), steps in order."""
        return [self._event(step, raw) for step, raws in self.steps for raw in raws]

    # ---- called by the engine -------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        if self._gpu is not None:
            self._gpu.start()
        self._raw, self._step, self._step_start = [], step, self.clock()
        self.posted.clear()

    def end_step(self) -> None:
        self._raw.append(("S", self._step_start, self.clock()))
        if self._gpu is not None:  # the step's stamps become times (one device sync)
            at = self._gpu.resolve()
            self._raw = [tuple(at(v) for v in raw) for raw in self._raw]
        self.steps.append((self._step, self._raw))

    def compute(self, kind: str, micro_batch: int, start: float, end: float, stage: int | None = None) -> None:
        """An op ran (``stage``: which of the rank's chunks; None where it holds one stage)."""
        self._raw.append(("C", start, end, kind, micro_batch, stage))

    def idle(self, start: float, end: float, waiting_for: Any) -> None:
        """``waiting_for``: a description, or the Op whose receives were waited for."""
        self._raw.append(("I", start, end, waiting_for))

    def transfer(self, direction: str, t: Transfer, nbytes: int, start: float, end: float) -> None:
        posted = self.posted.pop(t, None) if direction == "recv" else None
        self._raw.append(("T", start, end, direction, t, nbytes, posted))

    def allreduce_bucket(self, k: int, start: float, end: float, label: str, ranks: list[int], nbytes: int,
                         launched_in: str) -> None:
        self._raw.append(("R", start, end, k, label, ranks, nbytes, launched_in))

    def allreduce_wait(self, start: float, end: float, buckets: int) -> None:
        self._raw.append(("W", start, end, buckets))

    # ---- events -----------------------------------------------------------------------------------
    def _event(self, step: int, raw: tuple) -> Event:
        tag, start, end = raw[:3]
        mb: int | None = None
        args: dict[str, Any] = {}
        if tag == "C":
            kind, name, mb = ("forward" if raw[3] == "F" else "backward"), f"{raw[3]}{raw[4]}", raw[4]
            if raw[3] == "W":
                args["part"] = "weight"
            if len(raw) > 5 and raw[5] is not None:  # a chunk of the rank: F3@s5
                name, args["stage"] = f"{name}@s{raw[5]}", raw[5]
        elif tag == "I":
            kind, name = "idle", "idle"
            args["waiting_for"] = raw[3] if isinstance(raw[3], str) else f"receives of {raw[3]}"
        elif tag == "T":
            kind, t, nbytes, posted = raw[3:]
            peer = t.dst if kind == "send" else t.src
            name, mb = f"{kind}{ARROW[kind]}{peer}", t.micro_batch
            args.update(peer=peer, bytes=nbytes, what="activations" if t.kind == "act" else "gradients",
                        value=self.value_name(t), rows=[t.start, t.end])
            if posted is not None:
                args["posted_ms_before"] = round((start - posted) * 1e3, 4)
        elif tag == "R":
            k, label, ranks, nbytes, during = raw[3:]
            kind, name = "allreduce", f"AR bucket {k}"
            args.update(lane="allreduce", group=label, ranks=ranks, bytes=nbytes, launched_in=during)
        elif tag == "W":
            kind, name = "allreduce", "AR"
            args["waiting_for"] = f"gradient AllReduce ({raw[3]} bucket(s))"
        else:  # "S"
            kind, name = "other", f"step {step}"
            args["lane"] = "step"
        args["step"] = step
        return Event(self.rank, kind, name, start, end, mb, args)

    # ---- gathering --------------------------------------------------------------------------------
    def payload(self, info: dict) -> dict:
        """What this rank sends to rank 0: its identity, clock syncs and events (local clock)."""
        return dict(info, syncs=[s.to_list() for s in self.syncs], steps=[s for s, _ in self.steps],
                    events=[[e.kind, e.name, e.start, e.end, e.micro_batch, e.args] for e in self.events])


def merge(payloads: list[dict]) -> tuple[list[Event], dict[int, dict]]:
    """Every rank's events on rank 0's clock, and per rank its identity plus clock offset, error and drift."""
    events: list[Event] = []
    ranks: dict[int, dict] = {}
    for p in payloads:
        r = int(p["rank"])
        to0 = correction(p["syncs"])
        for kind, name, start, end, mb, args in p["events"]:
            events.append(Event(r, kind, name, to0(start), to0(end), mb, args))
        info = {k: v for k, v in p.items() if k not in ("syncs", "events")}
        syncs = sorted(p["syncs"])
        const = constant_offset(syncs)
        if const is not None:  # one offset fits every sync
            info["clock_offset_ms"], info["clock_error_ms"] = round(const[0] * 1e3, 4), round(const[1] * 1e3, 4)
        elif syncs:  # measurable drift: interpolated between the syncs
            info["clock_offset_ms"] = round(syncs[-1][1] * 1e3, 4)
            info["clock_error_ms"] = round(max(s[2] for s in syncs) * 1e3, 4)
            if syncs[-1][0] > syncs[0][0]:
                info["clock_drift_ppm"] = round((syncs[-1][1] - syncs[0][1]) / (syncs[-1][0] - syncs[0][0]) * 1e6,
                                                2)
        ranks[r] = info
    return events, ranks


class Traced(Protocol):
    """What a trace reads of the pipeline it records (:class:`dapple.Pipeline`): this rank's place in the plan,
    the timeout of collectives, boundary value names, and ``recorder``, where its steps log (None: nowhere)."""

    ctx: DistContext
    plan: Plan
    stage: int
    replica: int
    timeout: float
    recorder: Recorder | None

    def value_name(self, t: Transfer) -> str:
        ...


class Trace:
    """``with pipe.trace() as t: pipe.train_step(...)`` records the steps run in the block (enter it on every
    rank: starting syncs clocks); then ``t.save("trace.json")`` on every rank writes one merged Chrome trace."""

    def __init__(self, pipe: Traced):
        self._pipe = pipe
        self.recorder: Recorder | None = None
        self._previous: Recorder | None = None

    def __enter__(self) -> "Trace":
        self.recorder = start_recorder(self._pipe)
        self._previous, self._pipe.recorder = self._pipe.recorder, self.recorder
        return self

    def __exit__(self, *exc: Any) -> None:
        self._pipe.recorder = self._previous  # no collective here: the block may have raised on this rank only

    @property
    def events(self) -> list[Event]:
        """This rank's recorded events, on this rank's clock (``gather`` moves them onto rank 0's)."""
        return self.recorder.events if self.recorder is not None else []

    def gather(self) -> tuple[list[Event], dict] | None:
        """Collective: every rank's events on rank 0's clock plus trace metadata, on rank 0 (None elsewhere)."""
        if self.recorder is None:
            raise RuntimeError("Trace.gather: nothing was recorded; use 'with pipe.trace() as t:' first")
        return gather_trace(self._pipe, self.recorder)

    def save(self, path: str | os.PathLike) -> Path | None:
        """Collective: write the merged Chrome trace (Perfetto, chrome://tracing) to ``path`` on rank 0;
        returns the path there, None on the other ranks. ``dapple show PATH --png out.png`` draws it."""
        return write_trace(self.gather(), path)


def start_recorder(pipe: Traced, max_steps: int | None = None) -> Recorder:
    """A new recorder for ``pipe``'s rank (the last ``max_steps`` steps; None: all) with a first clock sync
    (collective)."""
    rec = Recorder(pipe.ctx.rank, max_steps, pipe.value_name, pipe.ctx.device)
    rec.syncs.append(sync_clock(rec.base_clock, pipe.ctx.rank, pipe.ctx.world_size, pipe.ctx.device, pipe.timeout))
    return rec


def gather_trace(pipe: Traced, rec: Recorder) -> tuple[list[Event], dict] | None:
    """Sync clocks again (drift), gather every rank's payload to rank 0 and merge (collective)."""
    ctx = pipe.ctx
    rec.syncs.append(sync_clock(rec.base_clock, ctx.rank, ctx.world_size, ctx.device, pipe.timeout))
    info = {"rank": ctx.rank, "stage": pipe.stage, "replica": pipe.replica, "host": socket.gethostname(),
            "pid": os.getpid(), "device": str(ctx.device)}
    payloads = gather_json(rec.payload(info), ctx.rank, ctx.world_size, ctx.device, pipe.timeout)
    if payloads is None:
        return None
    events, ranks = merge(payloads)
    plan = pipe.plan
    t0 = min((e.start for e in events), default=rec.base_clock())
    meta = {"dapple_trace": 1, "world_size": ctx.world_size, "backend": ctx.backend, "schedule": plan.schedule,
            "num_stages": plan.num_stages, "num_micro_batches": plan.num_micro_batches,
            "micro_batch_size": plan.micro_batch_size, "global_batch_size": plan.global_batch_size,
            "warmup": plan.warmup, "steps": sorted({s for p in payloads for s in p["steps"]}),
            "stage_of_rank": {str(r): i["stage"] for r, i in sorted(ranks.items())},
            "ranks": {str(r): i for r, i in sorted(ranks.items())},
            "clock": "each rank's time.perf_counter moved onto rank 0's by a ping-pong offset: the intersection of "
                     "the [T - b, T - a] intervals of 16 round trips, at the start of recording and at gathering; "
                     "error bound per rank in ranks[r].clock_error_ms (drift: interpolated, clock_drift_ppm)",
            "started_at_unix": time.time() - (rec.base_clock() - t0), "plan_summary": str(plan).splitlines(),
            "plan": plan.to_dict()}
    return events, meta


def rank_labels(meta: dict) -> dict[int, str]:
    """rank -> "rank 1 · stage 0 (replica 2/2)" from a trace's metadata."""
    out = {}
    counts: dict[int, int] = {}
    for i in (meta.get("ranks") or {}).values():
        counts[i["stage"]] = counts.get(i["stage"], 0) + 1
    for r, i in (meta.get("ranks") or {}).items():
        rep = f" ({i['replica'] + 1}/{counts[i['stage']]})" if counts[i["stage"]] > 1 else ""
        out[int(r)] = f"rank {r} · stage {i['stage']}{rep}"
    return out


def write_trace(gathered: tuple[list[Event], dict] | None, path: str | os.PathLike) -> Path | None:
    """Write what :func:`gather_trace` returned as a Chrome trace at ``path`` (rank 0); the path, or None where
    nothing was gathered (the other ranks)."""
    if gathered is None:
        return None
    events, meta = gathered
    save_chrome_trace(events, path, meta, rank_labels(meta))
    return Path(path)
