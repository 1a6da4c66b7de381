"""One training step of a rank: its program of receives, forwards, backwards (whole, or split into input and weight
gradients) and sends over its stage or chunks (runtime/chunk.py), then the AllReduces."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from ..core.chunk_schedule import ChunkOp
from ..core.schedule import Op
from .batchnorm import commit, gather_sums
from .channels import Channels
from .chunk import StageChunk, StepState, Tensors
from .data import StepBatch
from .loss_checks import problems
from .p2p import PipelineError
from .precision import overflowed, unscale
from .program import (
    AnyOp,
    BoundaryLayout,
    Instr,
    Transfer,
    forward_program,
    op_receives,
    op_stage,
    op_transfers,
    rank_program,
    receive_lookahead,
)
from .shapes import BoundaryShapes, InputKey, Spec
from .small_reduce import reduce_small
from .tracing import Recorder

NO_RANGE = nullcontext()  # in place of a record_function range when no profiler listens
CHECKS = 3  # slots after the loss and BatchNorm sums: a summed loss, a loss without gradient, a gradient overflow


@dataclass(frozen=True)
class Program:
    """A rank's program for one boundary layout, with what running it needs: each compute's receives and stage, and
    where the gradient buckets arm (``arm_at``: the compute before which they do; ``expect``: per id(parameter), the
    accumulations it still gets from there)."""

    instrs: list[Instr]
    waits: dict[AnyOp, list[Transfer]]
    stages: list[int]  # per compute instruction, in order: its stage
    arm_at: int = -1
    expect: dict[int, int] | None = None
    back: dict[int, set[int]] = field(default_factory=dict)  # per stage: the values whose gradients come back


@dataclass(frozen=True)
class Pass:
    """One pass of a rank's program over a batch: what its compute instructions read and where the losses go."""

    program: Program
    key: InputKey
    layout: BoundaryLayout
    xs: Tensors
    ys: Tensors
    loss_sum: torch.Tensor  # (), a view into the step's reduced vector
    rec: Recorder | None
    forward_only: bool = False
    kept: list[tuple[range, Any]] | None = None  # forward-only: each last-stage slice's rows and output


class StepRunner:
    """Runs this rank's program for a step: each forward concatenates the pieces received from the senders
    whose slices overlap its own (split-concat; a chunk of this rank hands its values over as they are), each
    backward sends gradients back along the same routes, and the step ends with the gradient AllReduce and one
    AllReduce of the loss (and deferred BatchNorm sums).

    Args:
        state: what the rank's chunks share (plan, device, loss, inputs, precision, scaler).
        chunks: this rank's stages (one, or its device group's chunks), in pipeline order.
        shapes: the boundary shapes per input shape.
        channels: the rank's P2P channels and gradient reducer.
        timeout: seconds every wait is bounded by.
    """

    def __init__(self, state: StepState, chunks: list[StageChunk], shapes: BoundaryShapes, channels: Channels,
                 timeout: float):
        self.state, self.plan, self.ctx = state, state.plan, state.ctx
        self.chunks = {c.stage: c for c in chunks}
        self.shapes, self.timeout = shapes, timeout
        self.p2p, self.reducer = channels.p2p, channels.reducer
        self.rows = chunks[0].rows  # of a micro-batch (every chunk of a device group holds the same)
        self.stats_length = chunks[0].stats.length
        names = ",".join(str(c.stage) for c in chunks)
        self.who = f"rank {self.ctx.rank} ({'stages' if len(chunks) > 1 else 'stage'} {names})"  # for errors
        self.everyone = range(self.ctx.world_size)  # the ranks of the loss AllReduce
        # False while a step's transfers or collectives may be in flight: an error then leaves the process groups
        # in an unknown state; True once they all completed (an error after that, e.g. a wrong loss, is the user's)
        self.settled = True
        self._programs: dict[tuple, Program] = {}
        self._wires: dict[tuple[int, InputKey], list[Spec | None]] = {}  # per program and input shapes
        self.ranges = False  # open record_function ranges: only under a profiler (each costs host time)

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def forward_module(self) -> nn.Module:
        """What runs the first chunk's forwards (the stage, its evaluation twin, compiled or not)."""
        return next(iter(self.chunks.values())).forward_module

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter of this rank's chunks, each once (one tied between two chunks is one tensor)."""
        return list({id(p): p for c in self.chunks.values() for p in c.module.parameters()}.values())

    def run(self, batch: StepBatch, step: int, rec: Recorder | None) -> float:
        """Run step ``step`` on the global batch (this rank's inputs and targets in ``batch``), recording into
        ``rec`` unless it is None; adds the step's gradients to ``.grad`` and returns the mean loss."""
        st = self.state
        st.step = self.p2p.step = step
        st.batch_rows = self.plan.global_batch_size
        self.settled = False
        xs, ys, key = batch.inputs, batch.targets, batch.key
        layout = self._boundary_layout(key)
        program = self._program(layout)
        # earlier gradients, added back at the end (one that lives in a gradient bucket is copied out: the buckets
        # start the step at zero); then the bucketed parameters' gradients become views of their buckets
        params = self.parameters()
        stash = {p: p.grad if p.grad is None or not self.reducer.holds(p.grad) else p.grad.clone() for p in params}
        for p in stash:
            p.grad = None
        self.reducer.attach()
        # reduced over all ranks at the end: the loss (the last stage's replicas add theirs), then every stage's
        # deferred BatchNorm sums in its slot (zeros elsewhere), so one AllReduce sums them over the replicas, then
        # the loss problems and whether some gradient overflowed (fp16): one decision for every rank
        reduced = torch.zeros(self.stats_length + CHECKS, dtype=torch.float64, device=self.ctx.device)  # (length,)
        st.flags = [0.0, 0.0]
        rec = self.p2p.rec = self.reducer.rec = rec  # tracing: one `is not None` test per instruction
        self.ranges = torch.autograd._profiler_enabled()  # torch.profiler, emit_nvtx (Nsight)
        if rec is not None:
            rec.begin_step(step)
        self._play(Pass(program, key, layout, xs, ys, reduced[0], rec))  # reduced[0] is a view into ``reduced``
        self._reduce(reduced, params, rec)
        self.settled = True  # every transfer and collective of the step completed
        checks = reduced[-CHECKS:].tolist()
        problem = problems(checks[:2], f"{self.who}, step {step}")
        if problem is None and st.scaler.enabled:
            st.scaler.found_inf = checks[2] > 0
            unscale(stash, st.scaler.scale)  # this step's gradients (the earlier ones are not scaled)
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

    def _play(self, run: Pass) -> None:
        """Run the program's instructions in order, adding each slice loss (last stage) into ``run.loss_sum``; a
        ``forward_only`` pass keeps nothing for a backward, but each slice's rows and output in ``run.kept``."""
        program, key = run.program, run.key
        for c in self.chunks.values():
            c.begin()
        outbox: list[torch.Tensor | None] = []
        computed = 0  # compute instructions run so far
        for ins, spec in zip(program.instrs, self._wire_specs(program, key)):
            if ins.action == "recv":
                t = ins.message
                if spec is not None:  # (a hand-off from a chunk of this rank is taken as it is)
                    self.p2p.post_recv(t, torch.empty(spec.shape, dtype=spec.dtype, device=self.ctx.device))
            elif ins.action == "send":
                t = ins.message
                if spec is None:
                    raise RuntimeError(f"{self.who}: no wire shape for {t}")
                lo = t.start - self.rows[0]  # rows of this rank's slice that the route covers (all: a whole value)
                value = outbox[t.value]
                if value is None:
                    raise RuntimeError(f"{self.who}: {t} sends value {t.value}, which its op left None")
                # detached: a send in flight until the step's end must not keep the graph (a split backward
                # retains it, so its saved tensors would live on)
                whole = spec.whole or (lo == 0 and t.rows == value.shape[0])  # (a slice costs host time)
                piece = (value if whole else value[lo:lo + t.rows]).detach()
                with record_function(f"send {t.kind} {t.micro_batch} to {t.dst}") if self.ranges else NO_RANGE:
                    self.p2p.send(t, self._checked(piece, spec, t))
            else:
                c = self.chunks[program.stages[computed]]
                if computed == program.arm_at and not run.forward_only:  # the buckets launch as gradients turn final
                    self.reducer.arm(program.expect)
                computed += 1
                outbox = self._compute(ins.compute_op, c, run)

    def _compute(self, op: AnyOp, c: StageChunk, run: Pass) -> list[torch.Tensor | None]:
        """One compute instruction of ``run``: wait for its receives, run ``op`` on chunk ``c``; what it sends on."""
        layout, rec, kept = run.layout, run.rec, run.kept
        j, kind = op.micro_batch, op.kind
        count = len(c.graph.recv if kind == "F" else c.graph.send)
        back = run.program.back[c.stage] if kind == "B" else set()
        # split: the graph is walked while the gradients are still on their way
        prepared = c.plan_backward(j, layout, back) if kind == "B" and c.split else None
        pieces = self._gather(op, run.program.waits[op], count, rec)
        start = rec.clock() if rec is not None else 0.0
        outbox: list[torch.Tensor | None] = []
        with record_function(str(op)) if self.ranges else NO_RANGE:
            if kind == "F":
                outbox = c.forward(j, pieces, run.xs, run.ys, layout, keep_output=kept is not None)
                m = c.alive.pop(j) if run.forward_only else c.alive[j]
                if m.loss is not None:
                    run.loss_sum.add_(m.loss.detach())  # in place: a view into the reduced vector
                    if kept is not None:
                        b = self.plan.micro_batch_size
                        kept.append((range(j * b + self.rows[0], j * b + self.rows[1]), m.output))
            elif kind == "B":
                outbox = c.backward(j, pieces, layout, back, prepared)
            else:
                c.backward_weight(j)
        if rec is not None:
            rec.compute(kind, j, start, rec.clock(), c.stage if isinstance(op, ChunkOp) else None)
        return outbox

    def evaluate(self, batch: StepBatch, step: int, outputs: bool) -> tuple[float, list[tuple[range, Any]]]:
        """A forward-only pass over ``batch`` (any multiple of the micro-batch size) under no_grad: the mean loss
        over all its rows (on every rank) and, with ``outputs``, this rank's model outputs (last stage: per
        micro-batch slice, its rows of the batch and the output; elsewhere none)."""
        st = self.state
        st.step = self.p2p.step = step
        st.batch_rows = batch.rows
        self.settled = False
        xs, ys, key = batch.inputs, batch.targets, batch.key
        layout = self._boundary_layout(key)
        program = self._program(layout, batch.rows // self.plan.micro_batch_size)
        reduced = torch.zeros(self.stats_length, dtype=torch.float64, device=self.ctx.device)  # as in a step
        kept: list[tuple[range, Any]] = []
        self.p2p.rec = self.reducer.rec = None
        self.ranges = torch.autograd._profiler_enabled()
        with torch.no_grad():
            self._play(Pass(program, key, layout, xs, ys, reduced[0], None, True, kept if outputs else None))
            self.p2p.finish()
            moment = f"evaluation after step {self.step}"
            # BatchNorm counts rows, as in training
            deferred = [c for c in self.chunks.values() if c.stats.layers and c.forward_module.training]
            for c in deferred:
                reduced[c.stats.slot] = gather_sums(c.stats.layers, f"{self.who}, {moment}")
            reduce_small(reduced, "sum", self.timeout, self.who, f"{moment}: loss AllReduce over all ranks",
                         self.everyone)
            for c in deferred:
                commit(c.stats.layers, reduced[c.stats.slot])
        self.settled = True
        return float(reduced[0]), kept

    def _reduce(self, reduced: torch.Tensor, params: list[nn.Parameter], rec: Recorder | None) -> None:
        """End of the step: wait for the sends, sum the gradients, then AllReduce ``reduced`` over all ranks."""
        start = rec.clock() if rec is not None else 0.0
        self.p2p.finish()
        if rec is not None:
            rec.idle(start, rec.clock(), "sends to complete")
        moment = f"step {self.step}"
        with record_function("AllReduce") if self.ranges else NO_RANGE:
            self.reducer.finish(self.timeout, self.who, moment)
        start = rec.clock() if rec is not None else 0.0
        overflow = self.state.scaler.enabled and overflowed(params)
        reduced[-CHECKS:] = torch.tensor([*self.state.flags, float(overflow)], dtype=torch.float64)
        for c in self.chunks.values():
            if c.stats.layers:
                reduced[c.stats.slot] = gather_sums(c.stats.layers, f"{self.who}, {moment}")
        with record_function("loss AllReduce") if self.ranges else NO_RANGE:
            reduce_small(reduced, "sum", self.timeout, self.who, f"{moment}: loss AllReduce over all ranks",
                         self.everyone)
        for c in self.chunks.values():
            commit(c.stats.layers, reduced[c.stats.slot])
        if rec is not None:
            rec.idle(start, rec.clock(), "loss AllReduce (all ranks)")

    def _gradients_back(self, layout: BoundaryLayout, stage: int) -> set[int]:
        """The values whose gradients come back to this replica of ``stage`` in a backward."""
        op = ChunkOp("B", 0, stage) if len(self.chunks) > 1 else Op("B", 0)
        return {t.value for t in op_transfers(self.plan, layout, self.ctx.rank, op)[0]}

    def _checked(self, x: torch.Tensor, spec: Spec, t: Transfer) -> torch.Tensor:
        """What goes on the wire must be what the receiver allocated (shape inference is a promise)."""
        if tuple(x.shape) != spec.shape:
            stage = t.cut if t.kind == "act" else t.cut + 1
            raise PipelineError(f"rank {self.ctx.rank} (stage {stage}), step {self.step}: "
                                f"{self.p2p.value_name(t)} of micro-batch {t.micro_batch} has shape {tuple(x.shape)} "
                                f"but shape inference (meta device) gave {spec.shape}; the model's shapes must not "
                                f"depend on values")
        # the wire's dtype, e.g. under autocast (meta runs without it); a hand-off too, as on a link
        return x if x.dtype == spec.dtype else x.to(spec.dtype)

    def _gather(self, op: AnyOp, recvs: list[Transfer], count: int, rec: Recorder | None
                ) -> list[list[torch.Tensor]]:
        """Wait for an op's receives; per value, the pieces in row order (routes are sorted by rows)."""
        pieces: list[list[torch.Tensor]] = [[] for _ in range(count)]
        start = rec.clock() if rec is not None and recvs else 0.0
        if recvs:
            with record_function(f"recv {op}") if self.ranges else NO_RANGE:
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

    def _program(self, layout: BoundaryLayout, forwards: int | None = None) -> Program:
        """This rank's program for ``layout`` (made once per layout): a training step's, or with ``forwards`` that of
        a forward-only pass of that many micro-batches."""
        if (layout, forwards) not in self._programs:
            ahead, rank = receive_lookahead(self.ctx.device), self.ctx.rank
            prog = rank_program(self.plan, layout, rank, ahead) if forwards is None else \
                forward_program(self.plan, layout, rank, forwards, ahead)
            ops = [i.compute_op for i in prog if i.action == "compute"]
            stages = [op_stage(self.plan, rank, op) for op in ops]
            arm_at, expect = self._arming(ops, stages) if forwards is None else (-1, None)
            back = {s: self._gradients_back(layout, s) for s in self.chunks}
            self._programs[(layout, forwards)] = Program(prog, op_receives(prog, rank, self.plan, layout), stages,
                                                         arm_at, expect, back)
        return self._programs[(layout, forwards)]

    def _arming(self, ops: list[AnyOp], stages: list[int]) -> tuple[int, dict[int, int]]:
        """Where the gradient buckets arm: before the first op after which each chunk has at most one op left that
        accumulates into its parameters (its last B, or W), so a bucket launches only once its gradients are
        final; and, per parameter, how many accumulations it gets from there (one per chunk using it that has
        one left; 0: already final)."""
        runs: dict[int, list[int]] = {}  # stage -> the indices of its accumulating ops
        for k, (op, s) in enumerate(zip(ops, stages)):
            if op.kind == self.chunks[s].arm:
                runs.setdefault(s, []).append(k)
        after = max(ks[-2] + 1 if len(ks) > 1 else 0 for ks in runs.values())
        arm_at = min(ks[-1] for ks in runs.values() if ks[-1] >= after)
        expect: dict[int, int] = {}
        for s, c in self.chunks.items():
            left = 1 if s in runs and runs[s][-1] >= arm_at else 0
            for p in c.module.parameters():
                expect[id(p)] = expect.get(id(p), 0) + left
        return arm_at, expect

    def _wire_specs(self, program: Program, key: InputKey) -> list[Spec | None]:
        """Per instruction of ``program``, for inputs of shapes ``key``: what a receive allocates or a send must
        carry (None: a compute, or a hand-off between this rank's chunks, which is received as it is)."""
        k = (id(program), key)
        if k not in self._wires:
            self._wires[k] = [None if i.action == "compute" or (i.action == "recv" and i.message.local) else
                              self._spec(key, i.message) for i in program.instrs]
        return self._wires[k]

    def _spec(self, key: InputKey, t: Transfer) -> Spec:
        spec = self.shapes.specs(key, t.rows)[t.cut][t.value]
        return spec._replace(dtype=self.state.precision.wire(spec.dtype))
