"""Timing layers on their own: forward and backward (and its weight-gradient part) from recorded inputs, in rounds;
saved-tensor sizes."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import Tensor
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from ..core.backward import backward_input, backward_weight
from ..core.selective import KeptBytes, selective_contexts
from .record import LayerModule, fresh
from .sizes import SavedTensors, tensors


@dataclass
class LayerMeasurement:
    """One layer at one batch size."""

    saved_bytes: int  # storages saved for backward, each once, parameters and buffers excluded
    saved_inputs: dict[fx.Node, int] = field(default_factory=dict)  # input node -> bytes of it the layer saved
    saved_outputs: set[fx.Node] = field(default_factory=set)  # output nodes the layer itself saved
    forward_s: list[float] = field(default_factory=list)  # one per timed run
    backward_s: list[float] = field(default_factory=list)
    weight_s: list[float] = field(default_factory=list)  # split backward runs: the weight-gradient part (W)
    split_s: list[float] = field(default_factory=list)  # the same runs: input gradients and W together
    kept_bytes: int = 0  # what selective recomputation keeps of the forward (core.selective.SAVED_OPS' outputs)
    selective_s: list[float] = field(default_factory=list)  # backwards of selectively checkpointed runs
    plain_s: list[float] = field(default_factory=list)  # backwards of plain runs, alternating with those

    @property
    def forward_ms(self) -> float:
        return statistics.median(self.forward_s) * 1e3

    @property
    def backward_ms(self) -> float:
        return statistics.median(self.backward_s) * 1e3

    @property
    def selective_ms(self) -> float:
        """What selective recomputation adds to the backward: the median of its backwards over the plain ones'
        (alternating runs), never below 0; 0 without runs."""
        if not self.selective_s or not self.plain_s:
            return 0.0
        return max(0.0, statistics.median(self.selective_s) - statistics.median(self.plain_s)) * 1e3

    @property
    def weight_share(self) -> float:
        """Of the backward, the share W takes in the split runs (0 without any: no backward)."""
        if not self.split_s or statistics.median(self.split_s) <= 0:
            return 0.0
        return min(1.0, statistics.median(self.weight_s) / statistics.median(self.split_s))


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def check_loss(loss: Any) -> Tensor:
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn must return a one-element tensor, got {type(loss).__name__} "
                         f"{tuple(getattr(loss, 'shape', ()))}")
    return loss


class LayerTimer:
    """Runs layer ``lm`` (plus the loss, for the last layer) forward and backward from copies of its inputs.

    ``measure_sizes()`` first (one untimed run with saved-tensor hooks, which also fixes the gradients that
    backward starts from), then ``run()`` as often as wanted; ``run(keep=True)`` records the times.
    """

    def __init__(self, lm: LayerModule, values: dict[fx.Node, Any], *, loss_fn: Callable | None, targets: Any,
                 state: set[int], device: torch.device, selective: bool = False):
        self.lm, self.values, self.targets, self.state = lm, values, targets, state
        self.selective = selective  # measure_sizes also measures what selective recomputation keeps
        self.loss_fn = loss_fn if lm.is_last else None
        self.sync, self.device = synchronizer(device), device
        self.grads: list[Tensor] | None = None
        self.result: LayerMeasurement | None = None

    def _args(self) -> list[Any]:
        return [tree_map(fresh, self.values[a]) for a in self.lm.inputs]

    def _forward(self, args: list[Any]) -> tuple[Any, list[Tensor]]:
        """-> (outputs, the tensors backward starts from: the loss, or every output that requires grad)."""
        out = self.lm.gm(*args)
        if self.loss_fn is not None:
            loss = check_loss(self.loss_fn(out, *self.targets))
            return out, [loss] if loss.requires_grad else []
        return out, [t for t in tensors(out) if t.requires_grad]

    def measure_sizes(self) -> LayerMeasurement:
        """What autograd saves, and which of the layer's inputs and outputs are among it (untimed)."""
        args = self._args()
        with SavedTensors(exclude=self.state) as saved:
            out, roots = self._forward(args)
        m = LayerMeasurement(saved_bytes=saved.total)
        for node, value in zip(self.lm.inputs, args):
            if b := saved.bytes_of(value):
                m.saved_inputs[node] = b
        if not self.lm.is_last:
            m.saved_outputs = {node for node, value in zip(self.lm.outputs, out) if saved.bytes_of(value)}
        self.grads = [torch.ones_like(t) for t in roots]  # d(output); a loss's own gradient is 1
        if roots:
            torch.autograd.backward(roots, self.grads)
        if self.selective:
            with KeptBytes(exclude=self.state) as kept:  # selective recomputation: what it would keep
                self._forward(self._args())
            m.kept_bytes = kept.total
        self.result = m
        return m

    def run(self, keep: bool = False) -> None:
        """One forward + backward from fresh input copies (in-place ops), clocks read after device syncs."""
        args, result, grads = self._ready()
        self.sync()
        t0 = time.perf_counter()
        out, roots = self._forward(args)
        self.sync()
        t1 = time.perf_counter()
        if roots:
            torch.autograd.backward(roots, grads)
        self.sync()
        t2 = time.perf_counter()
        if keep:
            result.forward_s.append(t1 - t0)
            result.backward_s.append(t2 - t1 if roots else 0.0)

    def split_run(self) -> None:
        """One forward, then the backward split as a zero-bubble schedule runs it (``core.backward``: input
        gradients, then weight gradients); records W's time and the whole split's (``weight_s``, ``split_s``)."""
        args, result, grads = self._ready()
        out, roots = self._forward(args)
        if not roots:
            return
        inputs = [t for t in tensors(args) if t.requires_grad]
        params = [p for p in self.lm.gm.parameters() if p.requires_grad]
        self.sync()
        t0 = time.perf_counter()
        _, work = backward_input(roots, grads, inputs, params)
        self.sync()
        t1 = time.perf_counter()
        backward_weight(work)
        self.sync()
        t2 = time.perf_counter()
        result.weight_s.append(t2 - t1)
        result.split_s.append(t2 - t0)

    def queue(self) -> tuple:
        """One forward + backward queued on the current CUDA stream between events, with no host sync: run layer
        after layer, the stream stays busy while Python queues the next, as in a training step. Read the events
        with :meth:`keep` once the stream is synchronised."""
        args, _, grads = self._ready()
        stream = torch.cuda.current_stream(self.device)  # where the layer's kernels go (not the current device's)
        marks = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
        marks[0].record(stream)
        out, roots = self._forward(args)
        marks[1].record(stream)
        if roots:
            torch.autograd.backward(roots, grads)
        marks[2].record(stream)
        return marks

    def keep(self, marks: tuple) -> None:
        """Record the forward and backward times between :meth:`queue`'s events (the stream synchronised)."""
        start, mid, end = marks
        result, grads = self._measured()  # set: :meth:`queue` ran
        result.forward_s.append(start.elapsed_time(mid) / 1e3)  # elapsed_time: ms
        result.backward_s.append(mid.elapsed_time(end) / 1e3 if grads else 0.0)

    def selective_run(self) -> None:
        """A plain forward and backward, then one under a selective checkpoint (``core.selective``: the backward
        recomputes what it did not keep); records both backwards (``plain_s``, ``selective_s``)."""
        args, result, grads = self._ready()
        if not grads:
            return
        for store, ctx in ((result.plain_s, None), (result.selective_s, selective_contexts)):
            run = self._forward if ctx is None else \
                lambda a: checkpoint(self._forward, a, use_reentrant=False, context_fn=ctx)
            out, roots = run(args)
            self.sync()
            t0 = time.perf_counter()
            torch.autograd.backward(roots, grads)
            self.sync()
            store.append(time.perf_counter() - t0)
            args = self._args()

    def _measured(self) -> tuple[LayerMeasurement, list[Tensor]]:
        """(the result, the gradients backward starts from), set by :meth:`measure_sizes`."""
        if self.result is None or self.grads is None:
            raise RuntimeError("LayerTimer.measure_sizes() must run first")
        return self.result, self.grads

    def _ready(self) -> tuple[list[Any], LayerMeasurement, list[Tensor]]:
        """(fresh input copies, the result, the gradients backward starts from)."""
        result, grads = self._measured()
        return self._args(), result, grads


def call_timer(device: torch.device, dtype: torch.dtype, state: set[int]) -> LayerTimer:
    """A timer of an empty layer (one op on one element): what calling a layer costs by itself, its module and,
    for its backward, autograd. Timed in the same rounds as the layers (on CUDA queued after them: where the GPU
    is still busy it costs nothing, where Python is what the GPU waits for it costs what a call costs)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(torch.mul, (x, 1.0)),))
    gm = fx.GraphModule(torch.nn.Module(), graph, class_name="EmptyLayer")
    lm = LayerModule(index=-1, gm=gm, inputs=[x], outputs=[], is_last=False)
    values = {x: torch.ones(1, device=device, dtype=dtype, requires_grad=True)}
    timer = LayerTimer(lm, values, loss_fn=None, targets=(), state=state, device=device)
    timer.measure_sizes()
    return timer


def step_seconds(model: torch.nn.Module, inputs: tuple[Tensor, ...], *, loss_fn: Callable | None, targets: Any,
                 sync: Callable[[], None]) -> float:
    """One whole-model training step (forward, loss, backward) in seconds: the yardstick for the layer sum."""
    args = [t.clone() for t in inputs]
    sync()
    t0 = time.perf_counter()
    out = model(*args)
    if loss_fn is not None:
        roots = [check_loss(loss_fn(out, *targets))]
    else:
        roots = [t for t in tensors(out) if t.requires_grad]
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    sync()
    return time.perf_counter() - t0


def time_rounds(groups: list[list[LayerTimer]], warmup: int, repeats: int, bar: Any, *,
                wholes: list[tuple] | None, device: torch.device) -> list[float]:
    """Warm-up rounds, then timed rounds, each running every layer once at every batch size.

    Interleaving rounds (the first batch size rotates from round to round) spreads a burst of load on a shared
    machine over all layers and batch sizes instead of inflating a few, and the medians drop it. On CUDA a round
    queues the layers of a batch size back to back and reads CUDA events once at its end (stream time), so no
    run pays host syncs or its first kernel's launch, as none does inside a training step; on the CPU, where
    nothing runs ahead, clocks are read around each run.

    Args:
        groups: per batch size, the timers of its layers in model order.
        warmup, repeats: untimed and timed rounds.
        bar: the progress bar (tqdm), advanced per layer run.
        wholes: per batch size (model, inputs, targets, loss_fn): each timed round then also times a whole-model
            step per batch size; None: no whole steps.
        device: where the layers run.

    Returns:
        The whole steps' median seconds, one per batch size (empty without ``wholes``).
    """
    steps: list[list[float]] = [[] for _ in groups]
    gc_was_enabled = gc.isenabled()
    gc.disable()  # no collector pauses inside a timed run
    try:
        for r in range(warmup + repeats):
            keep = r >= warmup
            bar.set_postfix_str(f"{'round' if keep else 'warm-up'} {r + 1 - warmup * keep}", refresh=False)
            for g in range(len(groups)):
                i = (g + r) % len(groups)
                _run_group(groups[i], keep, bar, device)
                if wholes is not None and r >= warmup - 1:  # the step gets one warm-up run of its own
                    model, x, y, loss_fn = wholes[i]
                    s = step_seconds(model, x, loss_fn=loss_fn, targets=y, sync=synchronizer(device))
                    if keep:
                        steps[i].append(s)
    finally:
        if gc_was_enabled:
            gc.enable()
    return [statistics.median(s) for s in steps] if wholes is not None else []


def time_weight_shares(groups: list[list[LayerTimer]], runs: int) -> None:
    """After the rounds: ``runs`` split backward runs of every layer at every batch size (``LayerTimer.split_run``),
    for each layer's weight-gradient share of its backward."""
    _each_run(groups, runs, LayerTimer.split_run)


def time_selective(groups: list[list[LayerTimer]], runs: int) -> None:
    """After the rounds: ``runs`` pairs of plain and selectively checkpointed runs of every layer at every batch size
    (``LayerTimer.selective_run``), for what selective recomputation adds to each layer's backward."""
    _each_run(groups, runs, LayerTimer.selective_run)


def _each_run(groups: list[list[LayerTimer]], runs: int, run: Callable[[LayerTimer], None]) -> None:
    """``run`` every timer of ``groups`` ``runs`` times, round by round, with the garbage collector paused."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(runs):
            for timers in groups:
                for t in timers:
                    run(t)
    finally:
        if gc_was_enabled:
            gc.enable()


def _run_group(timers: list[LayerTimer], keep: bool, bar: Any, device: torch.device) -> None:
    """Run one batch size's layers once each (recording their times if ``keep``)."""
    if device.type == "cuda":  # stream time: the layers queued back to back, read once synchronised
        marks = [t.queue() for t in timers]
        torch.cuda.synchronize(device)
        if keep:
            for t, m in zip(timers, marks):
                t.keep(m)
        bar.update(len(marks))
    else:
        for t in timers:
            t.run(keep=keep)
            bar.update()
