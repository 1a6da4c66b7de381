"""Timestamps of GPU work without a host sync per read: CUDA events on the stream, read once at the step's end."""

from __future__ import annotations

from typing import Any, Callable

import torch


class Stamp(int):
    """A time not yet known: the index of a CUDA event recorded in the current step (:class:`EventClock`)."""


class EventClock:
    """A clock for a rank on a CUDA device that never stalls the host while a step runs.

    Each read records a timing event on the current stream and returns a :class:`Stamp`; the stream reaches the
    event when the GPU has finished the work queued before it, so the time resolved later is when the GPU did
    the work, not when the host queued it. :meth:`start` (a step's beginning) syncs the device once and pins a
    reference event to the host clock; :meth:`resolve` (its end) syncs once more and turns every stamp into
    seconds on the host clock (``base``).

    ::

        host   start: sync, ref ── F0 ── F1 ── B0 ── ... ── resolve: sync, t = t_ref + ref.elapsed_time(ev)
        GPU           ref ──────── ev0 ───── ev1 ──── ...
    """

    def __init__(self, device: torch.device, base: Callable[[], float], event: Callable[[], Any] | None = None):
        self.device, self.base = device, base
        self._new = event if event is not None else (lambda: torch.cuda.Event(enable_timing=True))
        self._events: list[Any] = []
        self._ref: Any = None
        self._ref_host = 0.0

    def start(self) -> None:
        """Begin a step: the device idle, a reference event recorded at a known host time."""
        torch.cuda.synchronize(self.device)
        self._events = []
        self._ref = self._new()
        self._ref.record()
        self._ref_host = self.base()

    def __call__(self) -> Stamp:
        if self._ref is None:  # read outside a step (gathering a trace): the host clock is the answer
            return self.base()  # type: ignore[return-value]
        event = self._new()
        event.record()
        self._events.append(event)
        return Stamp(len(self._events) - 1)

    def resolve(self) -> Callable[[Any], Any]:
        """End the step: wait for the device once; returns a function mapping a stamp to host seconds (other
        values unchanged)."""
        torch.cuda.synchronize(self.device)
        ref, host = self._ref, self._ref_host
        times = [host + ref.elapsed_time(e) / 1e3 for e in self._events]
        self._ref = None
        return lambda v: times[v] if isinstance(v, Stamp) else v
