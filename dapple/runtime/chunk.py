"""One stage on a rank (the rank's only stage, or one of its chunks): its forwards, loss, and backwards, whole or
split into input gradients (B) and weight gradients (W)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from ..core.backward import BackwardPlan, WeightWork, backward_weight, plan_backward, run_backward_input
from ..core.plan import Plan, Recompute
from .batchnorm import StatsSlot
from .data import RowSource
from .distributed import DistContext
from .loss_checks import sums_rows
from .precision import LossScaler, Precision
from .program import BoundaryLayout
from .recompute import run_recomputed
from .stages import ModelInputs, StageGraph, resolve_output

Tensors = tuple[Optional[RowSource], ...]  # inputs or targets, sliced by global batch rows (None: not read here)
HALF = (torch.float16, torch.bfloat16)
Roots = list[tuple[Optional[int], torch.Tensor]]  # what a backward starts from: (sent value index or None, tensor)


def _rows(source: Optional[RowSource], lo: int, hi: int) -> torch.Tensor:
    """Global batch rows ``lo:hi`` of an input or target a stage reads (those it does not read are None)."""
    if source is None:
        raise ValueError(f"rows {lo}:{hi} of an input or target this rank was not given (None)")
    return source[lo:hi]


@dataclass
class StepState:
    """What a rank's chunks share during a step: the step, the rows of the batch being run, this step's loss
    problems (``loss_checks.problems``, summed over all ranks at the end)."""

    plan: Plan
    ctx: DistContext
    loss_fn: Callable[..., torch.Tensor]
    inputs: ModelInputs
    precision: Precision
    scaler: LossScaler
    step: int = 0
    batch_rows: int = 0
    flags: list[float] = field(default_factory=lambda: [0.0, 0.0])


class MicroBatch:
    """What one micro-batch keeps alive on a stage between its forward and its backward."""

    __slots__ = ("leaves", "sent", "loss", "output")

    def __init__(self, leaves: list[torch.Tensor], sent: list[torch.Tensor], loss: torch.Tensor | None,
                 output: Any = None):
        self.leaves = leaves  # received boundary values (autograd leaves), in ``StageGraph.recv`` order
        self.sent = sent  # boundary values sent on, in ``StageGraph.send`` order (their graph is kept)
        self.loss = loss  # last stage: the slice loss, scaled by rows / global batch
        self.output = output  # last stage, when evaluating with outputs: the model's output for the slice


class StageChunk:
    """Stage ``stage`` on this rank: its graph and module, the micro-batches alive on it, their pending W.

    Args:
        state: what the rank's chunks share.
        stage: the stage's index in the plan.
        graph, module: the stage's computation (``module`` on this rank's device).
        rows: this replica's rows of every micro-batch (every chunk of a device group has the same).
        stats: its deferred BatchNorms' slot in the loss AllReduce.
        recompute: how the stage runs its forward again in its backward (``core.plan.RECOMPUTE``; False: never).
        split: the schedule splits its backward into B and W (never for a recomputing stage: B runs it whole).
    """

    def __init__(self, state: StepState, stage: int, graph: StageGraph, module: nn.Module, rows: tuple[int, int],
                 stats: StatsSlot, *, recompute: Recompute = False, split: bool = False):
        self.state, self.stage, self.graph, self.module, self.rows = state, stage, graph, module, rows
        self.stats, self.recompute, self.split = stats, recompute, split
        self.forward_module: nn.Module = module  # what runs the forwards: ``module``, or its evaluation twin
        self.train_module: nn.Module = module  # what runs them in training (recompute="layers": layer by layer)
        plan = state.plan
        self.last = stage == plan.num_stages - 1
        # the previous stage is a chunk of this rank: its values come as they are (not copies off a link)
        self.local_in = stage > 0 and plan.chunks.same_group(stage - 1, stage)
        lo, hi = plan.stages[stage].layers
        self.layers = f"[{lo}, {hi})"  # for notes on errors
        self.arm = "W" if split else "B"  # the op whose last run makes the stage's parameter gradients final
        self.alive: dict[int, MicroBatch] = {}
        self.pending: dict[int, WeightWork] = {}  # split backward: micro-batches whose W is still to run
        self.back: dict[BoundaryLayout, set[int]] = {}  # gradients_back, per layout

    def begin(self) -> None:
        """Start of a step or evaluation: nothing alive."""
        self.alive, self.pending = {}, {}

    # ---- forward -----------------------------------------------------------------------------------
    def forward(self, j: int, pieces: list[list[torch.Tensor]], xs: Tensors, ys: Tensors, layout: BoundaryLayout,
                keep_output: bool = False) -> list[torch.Tensor | None]:
        """Micro-batch ``j``'s forward on this replica's rows; returns what to send on (nothing on the last stage,
        which computes the slice loss instead)."""
        st, g = self.state, self.graph
        b = st.plan.micro_batch_size
        lo, hi = j * b + self.rows[0], j * b + self.rows[1]  # this replica's rows of the global batch
        env: dict[str, Any] = {}
        for name in g.inputs:
            i = st.inputs.names.index(name)
            env[name] = _rows(xs[i], lo, hi).to(st.ctx.device, non_blocking=True) if i < len(xs) \
                else st.inputs.defaults[name]
        leaves: list[torch.Tensor] = []
        if self.stage > 0:  # concat: the pieces of each value from the senders whose slices overlap ours
            grads = set(layout.grads[self.stage - 1])
            for v, name in enumerate(g.recv):
                x = pieces[v][0] if len(pieces[v]) == 1 else torch.cat(pieces[v])  # (rows, ...)
                leaves.append(x.requires_grad_(v in grads))
                # leaves stay intact; a value handed over by a chunk of this rank is that chunk's own tensor
                copy = name in g.modified and (x.requires_grad or self.local_in)
                env[name] = x.clone() if copy else x
        args = [env[a] for a in g.args]
        with self.noted(j, lambda: f"in the forward of layers {self.layers}"), st.precision.autocast(st.ctx.device):
            if self.recompute in (True, "selective") and torch.is_grad_enabled():  # the backward recomputes
                outs = run_recomputed(self.forward_module, args, self.recompute)
            else:  # (a "layers" stage's train module checkpoints each layer itself)
                outs = self.forward_module(*args)
        env.update(zip(g.outs, outs))
        if self.last:
            out = resolve_output(g.output, env)
            self.alive[j] = MicroBatch(leaves, [], self.loss(j, out, ys, lo, hi), out if keep_output else None)
            return []
        sent = [env[name] for name in g.send]
        self.alive[j] = MicroBatch(leaves, sent, None)
        return sent

    def loss(self, j: int, out: Any, ys: Tensors, lo: int, hi: int) -> torch.Tensor:
        """The user's loss of rows ``lo:hi``, scaled by their share of the global batch."""
        st = self.state
        tgt = [_rows(y, lo, hi).to(st.ctx.device, non_blocking=True) for y in ys]
        with self.noted(j, lambda: f"in loss_fn(output {_shape(out)}, *targets {[_shape(t) for t in tgt]})"), \
                st.precision.autocast(st.ctx.device):
            loss = st.loss_fn(out, *tgt)  # the user's function: its error, and with what it was called
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"{self.where(j)}: loss_fn must return a scalar tensor (the mean over the rows it "
                                f"is given), got {loss!r:.80}")
            if torch.is_grad_enabled():
                if not loss.requires_grad:
                    st.flags[1] = 1.0
                elif st.step == 1 and j == 0 and sums_rows(st.loss_fn, out, tgt, loss):  # once: a loss call
                    st.flags[0] = 1.0
        loss = loss.reshape(())
        if loss.dtype in HALF:  # under autocast: the losses are summed (and scaled, fp16) in fp32
            loss = loss.float()
        return loss * ((hi - lo) / st.batch_rows)

    # ---- backward ----------------------------------------------------------------------------------
    def backward(self, j: int, pieces: list[list[torch.Tensor]], layout: BoundaryLayout, back: set[int],
                 prepared: tuple[Roots, BackwardPlan] | None = None) -> list[torch.Tensor | None]:
        """Micro-batch ``j``'s backward (split, ``prepared`` by :meth:`plan_backward`: its input gradients only, the
        rest kept for its W); returns the gradients to send back, per received value (None: none). ``back``: the
        values whose gradients come back to this replica (:meth:`gradients_back`)."""
        m = self.alive.pop(j)  # dropping it after this backward frees the micro-batch's activations (split: after W)
        found: dict[int, torch.Tensor | None] = {}
        with self.noted(j, lambda: f"in the backward of layers {self.layers}"):
            if prepared is not None:
                roots, plan = prepared
                got, self.pending[j] = run_backward_input(plan, self.root_grads(roots, pieces, layout))
                found = {id(x): g for x, g in zip(plan.inputs, got)}
            elif roots := self.root_values(m, layout, back):
                torch.autograd.backward([r for _, r in roots], self.root_grads(roots, pieces, layout))
        if self.stage == 0:
            return []
        out: list[torch.Tensor | None] = []
        for v, leaf in enumerate(m.leaves):
            if v in layout.grads[self.stage - 1]:
                g = found.get(id(leaf)) if prepared is not None else leaf.grad
                out.append(g if g is not None else torch.zeros_like(leaf))
            else:
                out.append(None)
        return out

    def plan_backward(self, j: int, layout: BoundaryLayout, back: set[int]) -> tuple[Roots, BackwardPlan]:
        """Micro-batch ``j``'s roots and the plan of its split backward (before its gradients are waited for)."""
        m = self.alive[j]
        roots = self.root_values(m, layout, back)
        with self.noted(j, lambda: f"in the backward of layers {self.layers}"):
            return roots, plan_backward([r for _, r in roots], [x for x in m.leaves if x.requires_grad],
                                        [p for p in self.module.parameters() if p.requires_grad])

    def root_values(self, m: MicroBatch, layout: BoundaryLayout, back: set[int]) -> Roots:
        """What micro-batch ``m``'s backward starts from: the (scaled) loss on the last stage (value None), else
        the sent values that require grad and whose gradient comes back (their index)."""
        scaler = self.state.scaler
        if m.loss is not None:
            if not m.loss.requires_grad:
                return []
            return [(None, m.loss * scaler.scale if scaler.enabled else m.loss)]
        # (a value sent whole comes back only from the receivers it went to)
        return [(v, m.sent[v]) for v in layout.grads[self.stage] if m.sent[v].requires_grad and v in back]

    def root_grads(self, roots: Roots, pieces: list[list[torch.Tensor]], layout: BoundaryLayout
                   ) -> list[torch.Tensor | None]:
        """The roots' gradients: None for the loss (one), else the pieces that came back (split-concat: along
        the routes the values went), concatenated; a value sent whole gets the sum of its receivers' gradients."""
        out: list[torch.Tensor | None] = []
        whole = layout.whole[self.stage] if self.stage < len(layout.whole) else ()  # (last stage: the loss)
        for v, root in roots:
            if v is None:
                out.append(None)
            elif len(pieces[v]) == 1:
                out.append(pieces[v][0].to(root.dtype))
            elif v in whole:  # each receiver's rows' share of its gradient
                out.append(torch.stack([g.to(root.dtype) for g in pieces[v]]).sum(0))
            else:
                out.append(torch.cat(pieces[v]).to(root.dtype))
        return out

    def backward_weight(self, j: int) -> None:
        """Micro-batch ``j``'s W: its parameter gradients into ``.grad``; then its activations are freed."""
        work = self.pending.pop(j, None)  # None where B ran the whole backward (a recomputed stage)
        if work is not None:
            with self.noted(j, lambda: f"in the weight-gradient backward of layers {self.layers}"):
                backward_weight(work)

    # ---- errors ------------------------------------------------------------------------------------
    def where(self, j: int) -> str:
        return f"rank {self.state.ctx.rank} (stage {self.stage}), step {self.state.step}, micro-batch {j}"

    @contextmanager
    def noted(self, j: int, what: Callable[[], str]) -> Iterator[None]:
        """Errors from the user's model or loss pass through as they are, with a note of where they were raised
        (micro-batch ``j``, then ``what()``; both formatted only on an error, not in every forward)."""
        try:
            yield
        except Exception as e:
            if hasattr(e, "add_note"):  # Python 3.11+
                e.add_note(f"{self.where(j)}: {what()}")
            raise


def _shape(x: Any) -> Any:
    """A tensor's shape as a tuple (for messages); anything else as its type name."""
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
