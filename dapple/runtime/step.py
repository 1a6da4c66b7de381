"""One training step of a stage replica: its program of receives, forwards, backwards (whole, or split into input
and weight gradients) and sends, then the AllReduces."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from ..core.backward import BackwardPlan, WeightWork, backward_weight, plan_backward, run_backward_input
from ..core.plan import Plan
from ..core.schedule import SPLIT_BACKWARD, Op
from ..core.split_concat import slice_bounds
from .batchnorm import StatsSlot, commit, gather_sums
from .channels import Channels
from .data import RowSource, StepBatch
from .distributed import DistContext
from .loss_checks import problems, sums_rows
from .p2p import PipelineError
from .precision import LossScaler, Precision, overflowed, unscale
from .program import (
    BoundaryLayout,
    Instr,
    Transfer,
    forward_program,
    op_receives,
    op_transfers,
    rank_program,
    receive_lookahead,
)
from .roll import waited
from .shapes import BoundaryShapes, InputKey, Spec
from .stages import ModelInputs, StageGraph, resolve_output
from .tracing import Recorder

Tensors = tuple[Optional[RowSource], ...]  # inputs or targets, sliced by global batch rows (None: not read here)
CHECKS = 3  # slots after the loss and BatchNorm sums: a summed loss, a loss without gradient, a gradient overflow
HALF = (torch.float16, torch.bfloat16)


class _MicroBatch:
    """What one micro-batch keeps alive on a stage between its forward and its backward."""

    __slots__ = ("leaves", "sent", "loss", "output")

    def __init__(self, leaves: list[torch.Tensor], sent: list[torch.Tensor], loss: torch.Tensor | None,
                 output: Any = None):
        self.leaves = leaves  # received boundary values (autograd leaves), in ``StageGraph.recv`` order
        self.sent = sent  # boundary values sent on, in ``StageGraph.send`` order (their graph is kept)
        self.loss = loss  # last stage: the slice loss, scaled by rows / global batch
        self.output = output  # last stage, when evaluating with outputs: the model's output for the slice


class StepRunner:
    """Runs this rank's program for a step: each forward concatenates the pieces received from the senders
    whose slices overlap its own (split-concat), each backward sends gradients back along the same routes, and
    the step ends with the gradient AllReduce and one AllReduce of the loss (and deferred BatchNorm sums)."""

    def __init__(self, plan: Plan, ctx: DistContext, stage: int, replica: int, graph: StageGraph, module: nn.Module,
                 loss_fn: Callable[..., torch.Tensor], inputs: ModelInputs, shapes: BoundaryShapes,
                 channels: Channels, stats: StatsSlot, timeout: float, *, precision: Precision = Precision(),
                 scaler: LossScaler | None = None, recompute: bool = False):
        self.plan, self.ctx, self.stage = plan, ctx, stage
        self.precision, self.recompute = precision, recompute
        # split backward (B: input gradients, W: parameter gradients later); a recomputed stage, whose saved
        # tensors are rebuilt once per backward, runs its whole backward in B and nothing in W
        self.split = plan.schedule in SPLIT_BACKWARD and not recompute
        self.scaler = scaler if scaler is not None else LossScaler(False)
        self.flags = [0.0, 0.0]  # this step's loss problems (loss_checks.problems), summed over all ranks
        self.graph, self.module, self.loss_fn = graph, module, loss_fn
        self.forward_module: nn.Module = module  # what runs the forwards: ``module``, or its evaluation twin
        self.inputs, self.shapes, self.stats, self.timeout = inputs, shapes, stats, timeout
        self.p2p, self.reducer = channels.p2p, channels.reducer
        lo, hi = plan.stages[stage].layers
        self.layers = f"[{lo}, {hi})"  # for notes on errors
        self.rows = slice_bounds(plan.micro_batch_size, plan.stages[stage].replicas)[replica]  # of a micro-batch
        self.step = 0
        self.batch_rows = plan.global_batch_size  # rows of the batch being run (an evaluation may run others)
        self.everyone = range(ctx.world_size)  # the ranks of the loss AllReduce
        # False while a step's transfers or collectives may be in flight: an error then leaves the process groups
        # in an unknown state; True once they all completed (an error after that, e.g. a wrong loss, is the user's)
        self.settled = True
        self._programs: dict[tuple, tuple[list[Instr], dict[Op, list[Transfer]]]] = {}
        self._back: dict[BoundaryLayout, set[int]] = {}  # _gradients_back, per layout

    def run(self, batch: StepBatch, step: int, rec: Recorder | None) -> float:
        """Run step ``step`` on the global batch (this rank's inputs and targets in ``batch``), recording into
        ``rec`` unless it is None; adds the step's gradients to ``.grad`` and returns the mean loss."""
        self.step = self.p2p.step = step
        self.batch_rows = self.plan.global_batch_size
        self.settled = False
        xs, ys, key = batch.inputs, batch.targets, batch.key
        layout = self._boundary_layout(key)
        program, waits = self._program(layout)
        # earlier gradients, added back at the end (one that lives in a gradient bucket is copied out: the buckets
        # start the step at zero); then the bucketed parameters' gradients become views of their buckets
        stash = {p: p.grad if p.grad is None or not self.reducer.holds(p.grad) else p.grad.clone()
                 for p in self.module.parameters()}
        for p in stash:
            p.grad = None
        self.reducer.attach()
        # reduced over all ranks at the end: the loss (the last stage's replicas add theirs), then every stage's
        # deferred BatchNorm sums in its slot (zeros elsewhere), so one AllReduce sums them over the replicas, then
        # the loss problems and whether some gradient overflowed (fp16): one decision for every rank
        reduced = torch.zeros(self.stats.length + CHECKS, dtype=torch.float64, device=self.ctx.device)  # (length,)
        self.flags = [0.0, 0.0]
        rec = self.p2p.rec = self.reducer.rec = rec  # tracing: one `is not None` test per instruction
        if rec is not None:
            rec.begin_step(step)
        self._play(program, waits, key, layout, xs, ys, reduced[0], rec)  # reduced[0] is a view into ``reduced``
        self._reduce(reduced, rec)
        self.settled = True  # every transfer and collective of the step completed
        checks = reduced[-CHECKS:].tolist()
        problem = problems(checks[:2], f"rank {self.ctx.rank} (stage {self.stage}), step {step}")
        if problem is None and self.scaler.enabled:
            self.scaler.found_inf = checks[2] > 0
            unscale(stash, self.scaler.scale)  # this step's gradients (the earlier ones are not scaled)
        for p, old in stash.items():
            if problem is not None:
                p.grad = old  # the step's gradients are wrong: the parameters keep what they had
            elif old is not None:
                p.grad = old if p.grad is None else p.grad.add_(old)
        if rec is not None:
            rec.end_step()
        if problem is not None:
            raise ValueError(problem)
        return float(reduced[0])

    def _play(self, program: list[Instr], waits: dict[Op, list[Transfer]], key: InputKey, layout: BoundaryLayout,
              xs: Tensors, ys: Tensors, loss_sum: torch.Tensor, rec: Recorder | None, forward_only: bool = False,
              kept: list[tuple[range, Any]] | None = None) -> None:
        """Run the program's instructions in order, adding each slice loss (last stage) into ``loss_sum``; a
        ``forward_only`` program keeps nothing for a backward, but each slice's rows and output in ``kept``."""
        alive: dict[int, _MicroBatch] = {}
        pending: dict[int, WeightWork] = {}  # split backward: micro-batches whose W is still to run
        outbox: list[torch.Tensor | None] = []
        arm = "W" if self.split else "B"  # the op whose last run makes the stage's parameter gradients final
        for ins in program:
            t = ins.transfer
            if ins.action == "recv":
                spec = self._spec(key, t)
                self.p2p.post_recv(t, torch.empty(spec.shape, dtype=spec.dtype, device=self.ctx.device))
            elif ins.action == "send":
                spec = self._spec(key, t)
                lo = t.start - self.rows[0]  # rows of this rank's slice that the route covers (all: a whole value)
                # detached: a send in flight until the step's end must not keep the graph (a split backward
                # retains it, so its saved tensors would live on)
                piece = (outbox[t.value] if spec.whole else outbox[t.value][lo:lo + t.rows]).detach()
                with record_function(f"send {t.kind} {t.micro_batch} to {t.dst}"):  # (torch.profiler, Nsight)
                    self.p2p.send(t, self._checked(piece, spec, t))
            else:
                j, kind = ins.op.micro_batch, ins.op.kind
                count = len(self.graph.recv if kind == "F" else self.graph.send)
                # split: the graph is walked while the gradients are still on their way
                prepared = self._plan_backward(j, alive, layout) if kind == "B" and self.split else None
                pieces = self._gather(ins.op, waits[ins.op], count, rec)
                start = rec.clock() if rec is not None else 0.0
                if kind == arm and j == self.plan.num_micro_batches - 1:  # the last backward of the step
                    self.reducer.arm()  # gradient AllReduce buckets start as their gradients become final
                with record_function(f"{kind}{j}"):
                    if kind == "F":
                        outbox = self._forward(j, pieces, xs, ys, alive, layout, keep_output=kept is not None)
                        m = alive.pop(j) if forward_only else alive[j]
                        if m.loss is not None:
                            loss_sum += m.loss.detach()
                            if kept is not None:
                                b = self.plan.micro_batch_size
                                kept.append((range(j * b + self.rows[0], j * b + self.rows[1]), m.output))
                    elif kind == "B":
                        outbox = self._backward(j, pieces, alive, layout, pending, prepared)
                    else:
                        self._backward_weight(j, pending)
                if rec is not None:
                    rec.compute(kind, j, start, rec.clock())

    def evaluate(self, batch: StepBatch, step: int, outputs: bool) -> tuple[float, list[tuple[range, Any]]]:
        """A forward-only pass over ``batch`` (any multiple of the micro-batch size) under no_grad: the mean loss
        over all its rows (on every rank) and, with ``outputs``, this rank's model outputs (last stage: per
        micro-batch slice, its rows of the batch and the output; elsewhere none)."""
        self.step = self.p2p.step = step
        self.batch_rows = batch.rows
        self.settled = False
        xs, ys, key = batch.inputs, batch.targets, batch.key
        layout = self._boundary_layout(key)
        micro_batches = self.batch_rows // self.plan.micro_batch_size
        program, waits = self._program(layout, micro_batches)
        reduced = torch.zeros(self.stats.length, dtype=torch.float64, device=self.ctx.device)  # as in a step
        kept: list[tuple[range, Any]] = []
        self.p2p.rec = self.reducer.rec = None
        with torch.no_grad():
            self._play(program, waits, key, layout, xs, ys, reduced[0], None, True, kept if outputs else None)
            self.p2p.finish()
            who, moment = f"rank {self.ctx.rank} (stage {self.stage})", f"evaluation after step {self.step}"
            deferred = bool(self.stats.layers) and self.forward_module.training  # BatchNorm counts rows, as in training
            if deferred:
                reduced[self.stats.slot] = gather_sums(self.stats.layers, f"{who}, {moment}")
            waited(dist.all_reduce(reduced, async_op=True), self.timeout, who, f"{moment}: loss AllReduce over all "
                   f"ranks", self.everyone)
            if deferred:
                commit(self.stats.layers, reduced[self.stats.slot])
        self.settled = True
        return float(reduced[0]), kept

    def _reduce(self, reduced: torch.Tensor, rec: Recorder | None) -> None:
        """End of the step: wait for the sends, sum the gradients, then AllReduce ``reduced`` over all ranks."""
        start = rec.clock() if rec is not None else 0.0
        self.p2p.finish()
        if rec is not None:
            rec.idle(start, rec.clock(), "sends to complete")
        who, moment = f"rank {self.ctx.rank} (stage {self.stage})", f"step {self.step}"
        with record_function("AllReduce"):
            self.reducer.finish(self.timeout, who, moment)
        start = rec.clock() if rec is not None else 0.0
        overflow = self.scaler.enabled and overflowed(self.module.parameters())
        reduced[-CHECKS:] = torch.tensor([*self.flags, float(overflow)], dtype=torch.float64)
        if self.stats.layers:
            reduced[self.stats.slot] = gather_sums(self.stats.layers, f"{who}, {moment}")
        with record_function("loss AllReduce"):
            waited(dist.all_reduce(reduced, async_op=True), self.timeout, who,
                   f"{moment}: loss AllReduce over all ranks", self.everyone)
        commit(self.stats.layers, reduced[self.stats.slot])
        if rec is not None:
            rec.idle(start, rec.clock(), "loss AllReduce (all ranks)")

    def _forward(self, j: int, pieces: list[list[torch.Tensor]], xs: Tensors, ys: Tensors,
                 alive: dict[int, _MicroBatch], layout: BoundaryLayout, keep_output: bool = False
                 ) -> list[torch.Tensor | None]:
        """Micro-batch ``j``'s forward on this replica's rows; returns what to send on (nothing on the last stage,
        which computes the slice loss instead)."""
        g, b = self.graph, self.plan.micro_batch_size
        lo, hi = j * b + self.rows[0], j * b + self.rows[1]  # this replica's rows of the global batch
        env: dict[str, Any] = {}
        for name in g.inputs:
            i = self.inputs.names.index(name)
            env[name] = xs[i][lo:hi].to(self.ctx.device, non_blocking=True) if i < len(xs) \
                else self.inputs.defaults[name]
        leaves: list[torch.Tensor] = []
        if self.stage > 0:  # concat: the pieces of each value from the senders whose slices overlap ours
            grads = set(layout.grads[self.stage - 1])
            for v, name in enumerate(g.recv):
                x = pieces[v][0] if len(pieces[v]) == 1 else torch.cat(pieces[v])  # (rows, ...)
                leaves.append(x.requires_grad_(v in grads))
                env[name] = x.clone() if name in g.modified and x.requires_grad else x  # leaves stay intact
        args = [env[a] for a in g.args]
        with self._noted(j, lambda: f"in the forward of layers {self.layers}"), \
                self.precision.autocast(self.ctx.device):
            if self.recompute and torch.is_grad_enabled():  # keep the inputs only: the backward runs the forward again
                outs = checkpoint(self.forward_module, *args, use_reentrant=False)
            else:
                outs = self.forward_module(*args)
        env.update(zip(g.outs, outs))
        if self.stage == self.plan.num_stages - 1:
            out = resolve_output(g.output, env)
            alive[j] = _MicroBatch(leaves, [], self._loss(j, out, ys, lo, hi), out if keep_output else None)
            return []
        sent = [env[name] for name in g.send]
        alive[j] = _MicroBatch(leaves, sent, None)
        return sent

    def _loss(self, j: int, out: Any, ys: Tensors, lo: int, hi: int) -> torch.Tensor:
        """The user's loss of rows ``lo:hi``, scaled by their share of the global batch."""
        tgt = [y[lo:hi].to(self.ctx.device, non_blocking=True) for y in ys]
        with self._noted(j, lambda: f"in loss_fn(output {_shape(out)}, *targets {[_shape(t) for t in tgt]})"), \
                self.precision.autocast(self.ctx.device):
            loss = self.loss_fn(out, *tgt)  # the user's function: its error, and with what it was called
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"{self._where(j)}: loss_fn must return a scalar tensor (the mean over the rows it "
                                f"is given), got {loss!r:.80}")
            if torch.is_grad_enabled():
                if not loss.requires_grad:
                    self.flags[1] = 1.0
                elif self.step == 1 and j == 0 and sums_rows(self.loss_fn, out, tgt, loss):  # once: a loss call
                    self.flags[0] = 1.0
        loss = loss.reshape(())
        if loss.dtype in HALF:  # under autocast: the losses are summed (and scaled, fp16) in fp32
            loss = loss.float()
        return loss * ((hi - lo) / self.batch_rows)

    def _backward(self, j: int, pieces: list[list[torch.Tensor]], alive: dict[int, _MicroBatch],
                  layout: BoundaryLayout, pending: dict[int, WeightWork],
                  prepared: tuple[list[tuple[int | None, torch.Tensor]], BackwardPlan] | None = None
                  ) -> list[torch.Tensor | None]:
        """Micro-batch ``j``'s backward (split, ``prepared`` by :meth:`_plan_backward`: its input gradients only,
        the rest kept in ``pending`` for its W); returns the gradients to send back, per received value (None:
        none)."""
        m = alive.pop(j)  # dropping it after this backward frees the micro-batch's activations (split: after W)
        found: dict[int, torch.Tensor | None] = {}
        with self._noted(j, lambda: f"in the backward of layers {self.layers}"):
            if prepared is not None:
                roots, plan = prepared
                got, pending[j] = run_backward_input(plan, self._root_grads(roots, pieces, layout))
                found = {id(x): g for x, g in zip(plan.inputs, got)}
            elif roots := self._root_values(m, layout):
                torch.autograd.backward([r for _, r in roots], self._root_grads(roots, pieces, layout))
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

    def _plan_backward(self, j: int, alive: dict[int, _MicroBatch], layout: BoundaryLayout
                       ) -> tuple[list[tuple[int | None, torch.Tensor]], BackwardPlan]:
        """Micro-batch ``j``'s roots and the plan of its split backward (before its gradients are waited for)."""
        m = alive[j]
        roots = self._root_values(m, layout)
        with self._noted(j, lambda: f"in the backward of layers {self.layers}"):
            return roots, plan_backward([r for _, r in roots], [x for x in m.leaves if x.requires_grad],
                                        [p for p in self.module.parameters() if p.requires_grad])

    def _root_values(self, m: _MicroBatch, layout: BoundaryLayout) -> list[tuple[int | None, torch.Tensor]]:
        """What micro-batch ``m``'s backward starts from: the (scaled) loss on the last stage (value None), else
        the sent values that require grad and whose gradient comes back (their index)."""
        if m.loss is not None:
            if not m.loss.requires_grad:
                return []
            return [(None, m.loss * self.scaler.scale if self.scaler.enabled else m.loss)]
        back = self._gradients_back(layout)  # (a value sent whole comes back only from the receivers it went to)
        return [(v, m.sent[v]) for v in layout.grads[self.stage] if m.sent[v].requires_grad and v in back]

    def _gradients_back(self, layout: BoundaryLayout) -> set[int]:
        """The values whose gradients come back to this replica in a backward (per layout, made once)."""
        if layout not in self._back:
            self._back[layout] = {t.value for t in op_transfers(self.plan, layout, self.ctx.rank, Op("B", 0))[0]}
        return self._back[layout]

    def _root_grads(self, roots: list[tuple[int | None, torch.Tensor]], pieces: list[list[torch.Tensor]],
                    layout: BoundaryLayout) -> list[torch.Tensor | None]:
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

    def _backward_weight(self, j: int, pending: dict[int, WeightWork]) -> None:
        """Micro-batch ``j``'s W: its parameter gradients into ``.grad``; then its activations are freed."""
        work = pending.pop(j, None)  # None where B ran the whole backward (a recomputed stage)
        if work is not None:
            with self._noted(j, lambda: f"in the weight-gradient backward of layers {self.layers}"):
                backward_weight(work)

    def _where(self, j: int) -> str:
        return f"rank {self.ctx.rank} (stage {self.stage}), step {self.step}, micro-batch {j}"

    @contextmanager
    def _noted(self, j: int, what: Callable[[], str]) -> Iterator[None]:
        """Errors from the user's model or loss pass through as they are, with a note of where they were raised
        (micro-batch ``j``, then ``what()``; both formatted only on an error, not in every forward)."""
        try:
            yield
        except Exception as e:
            if hasattr(e, "add_note"):  # Python 3.11+
                e.add_note(f"{self._where(j)}: {what()}")
            raise

    def _checked(self, x: torch.Tensor, spec: Spec, t: Transfer) -> torch.Tensor:
        """What goes on the wire must be what the receiver allocated (shape inference is a promise)."""
        if tuple(x.shape) != spec.shape:
            raise PipelineError(f"rank {self.ctx.rank} (stage {self.stage}), step {self.step}: "
                                f"{self.p2p.value_name(t)} of micro-batch {t.micro_batch} has shape {tuple(x.shape)} "
                                f"but shape inference (meta device) gave {spec.shape}; the model's shapes must not "
                                f"depend on values")
        return x if x.dtype == spec.dtype else x.to(spec.dtype)  # e.g. under autocast (meta runs without it)

    def _gather(self, op: Op, recvs: list[Transfer], count: int, rec: Recorder | None) -> list[list[torch.Tensor]]:
        """Wait for an op's receives; per value, the pieces in row order (routes are sorted by rows)."""
        pieces: list[list[torch.Tensor]] = [[] for _ in range(count)]
        start = rec.clock() if rec is not None and recvs else 0.0
        if recvs:
            with record_function(f"recv {op.kind}{op.micro_batch}"):
                for t in recvs:
                    pieces[t.value].append(self.p2p.wait_recv(t))
        if rec is not None and recvs:
            rec.idle(start, rec.clock(), op)
        return pieces

    # ---- plans for the communication ------------------------------------------------------------
    def _boundary_layout(self, key: InputKey) -> BoundaryLayout:
        specs = self.shapes.specs(key, self.plan.micro_batch_size)
        return BoundaryLayout(values=tuple(len(c) for c in specs),
                              grads=tuple(tuple(v for v, sp in enumerate(c) if sp.requires_grad) for c in specs),
                              whole=tuple(tuple(v for v, sp in enumerate(c) if sp.whole) for c in specs))

    def _program(self, layout: BoundaryLayout, forwards: int | None = None
                 ) -> tuple[list[Instr], dict[Op, list[Transfer]]]:
        """This rank's program for ``layout`` and each compute's receives (made once per layout): a training
        step's, or with ``forwards`` that of a forward-only pass of that many micro-batches."""
        if (layout, forwards) not in self._programs:
            ahead = receive_lookahead(self.ctx.device)
            prog = rank_program(self.plan, layout, self.ctx.rank, ahead) if forwards is None else \
                forward_program(self.plan, layout, self.ctx.rank, forwards, ahead)
            self._programs[(layout, forwards)] = (prog, op_receives(prog, self.ctx.rank, self.plan, layout))
        return self._programs[(layout, forwards)]

    def _spec(self, key: InputKey, t: Transfer) -> Spec:
        spec = self.shapes.specs(key, t.rows)[t.cut][t.value]
        return spec._replace(dtype=self.precision.wire(spec.dtype))


def _shape(x: Any) -> Any:
    """A tensor's shape as a tuple (for messages); anything else as its type name."""
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
