"""GPU timestamps without a host sync per read: stamps recorded on the stream, resolved once at the step's end."""

from __future__ import annotations

import time

import pytest
import torch

from dapple.runtime import gpu_clock
from dapple.runtime.gpu_clock import EventClock, Stamp
from dapple.runtime.tracing import Recorder


class FakeEvent:
    """A CUDA event on a device that runs each queued op ``lag`` seconds after the host queued it."""

    lag = 0.004

    def record(self) -> None:
        self.at = time.perf_counter() + self.lag

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.at - self.at) * 1e3  # ms, as torch.cuda.Event's


@pytest.fixture
def syncs(monkeypatch):
    calls = []
    monkeypatch.setattr(gpu_clock.torch.cuda, "synchronize", lambda device=None: calls.append(device))
    return calls


def test_stamps_resolve_to_when_the_device_reached_them_with_two_syncs_per_step(syncs):
    clock = EventClock(torch.device("cuda", 0), time.perf_counter, FakeEvent)
    clock.start()
    queued = []
    stamps = []
    for _ in range(5):
        queued.append(time.perf_counter())
        stamps.append(clock())
        time.sleep(0.002)
    assert all(isinstance(s, Stamp) for s in stamps) and len(syncs) == 1  # no sync per read
    at = clock.resolve()
    assert len(syncs) == 2
    times = [at(s) for s in stamps]
    assert times == sorted(times)
    # the reference event's lag cancels: each time is its queueing time (within the host's jitter)
    for q, t in zip(queued, times):
        assert abs(t - q) < 1e-3, (t - q)
    assert at(7) == 7 and at("x") == "x"  # what is not a stamp passes through


def test_a_cuda_recorder_stores_times_not_stamps(syncs, monkeypatch):
    monkeypatch.setattr(gpu_clock.torch.cuda, "Event", lambda enable_timing=True: FakeEvent())
    rec = Recorder(0, device=torch.device("cuda", 0))
    rec.begin_step(1)
    start = rec.clock()
    rec.compute("F", 0, start, rec.clock())
    rec.end_step()
    assert len(syncs) == 2
    (event,) = [e for e in rec.events if e.kind == "forward"]
    assert isinstance(event.start, float) and not isinstance(event.start, Stamp) and event.end >= event.start
    assert not isinstance(rec.base_clock(), Stamp)
