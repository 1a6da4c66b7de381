"""profiler/measure on CUDA's path, run on the CPU: the layers of a round queued back to back, timed by their events."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn
from tqdm.auto import tqdm

from dapple.profiler import trace_layers
from dapple.profiler.measure import LayerTimer, time_rounds
from dapple.profiler.record import layer_module, record_inputs
from dapple.profiler.sizes import state_storages

CLOCK = [0.0]  # a stand-in for the GPU's clock, ms: only _Tick moves it


class _Tick(torch.autograd.Function):
    """Identity that takes ``f_ms`` of the stand-in clock forward and ``b_ms`` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, f_ms: float, b_ms: float) -> torch.Tensor:  # type: ignore[override]
        ctx.b_ms = b_ms
        CLOCK[0] += f_ms
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        CLOCK[0] += ctx.b_ms
        return grad.clone(), None, None


def tick(x: torch.Tensor, f_ms: float, b_ms: float) -> torch.Tensor:
    return _Tick.apply(x, f_ms, b_ms)


torch.fx.wrap("tick")


class Ticking(nn.Module):
    def __init__(self, f_ms: float, b_ms: float):
        super().__init__()
        self.lin, self.f_ms, self.b_ms = nn.Linear(4, 4), f_ms, b_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 4) -> (B, 4)
        return tick(self.lin(x), self.f_ms, self.b_ms)


class FakeEvent:
    """torch.cuda.Event's part the profiler uses, on the stand-in clock."""

    made: list["FakeEvent"] = []

    def __init__(self, enable_timing: bool = False):
        self.t: float | None = None
        self.stream = None
        FakeEvent.made.append(self)

    def record(self, stream=None) -> None:
        self.t, self.stream = CLOCK[0], stream

    def elapsed_time(self, end: "FakeEvent") -> float:  # ms
        return end.t - self.t


def test_cuda_rounds_queue_the_layers_and_time_each_between_its_events(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    FakeEvent.made.clear()
    costs = [(1.0, 3.0), (2.0, 5.0), (4.0, 9.0)]  # (forward, backward) ms of each layer
    model = nn.Sequential(*[Ticking(f, b) for f, b in costs])
    dev = torch.device("cuda", 1)  # the path's name only: the tensors stay on the CPU
    lg = trace_layers(model)
    layers = [layer_module(lg, k) for k in range(lg.num_layers)]
    state = state_storages([model, lg.gm])
    groups = []
    for rows in (2, 4):
        values = record_inputs(lg, layers, (torch.randn(rows, 4),))
        timers = [LayerTimer(lm, values, loss_fn=None, targets=(), state=state, device=dev) for lm in layers]
        for t in timers:
            t.measure_sizes()
        groups.append(timers)
    syncs.clear()
    bar = tqdm(disable=True)
    assert time_rounds(groups, warmup=2, repeats=3, bar=bar, wholes=None, device=dev) == []
    assert syncs == [dev] * (2 + 3) * 2  # once per batch size and round, never between layers
    assert len(FakeEvent.made) == 3 * 3 * (2 + 3) * 2 and all(e.stream == ("stream of", dev) for e in FakeEvent.made)
    for timers in groups:
        for t, (f, b) in zip(timers, costs):  # the timed rounds only, each layer's own share of the clock
            assert t.result.forward_s == [f / 1e3] * 3 and t.result.backward_s == [b / 1e3] * 3
            assert t.result.forward_ms == f and t.result.backward_ms == b
