"""The Pipeline: one stage replica per rank, run through the dapple (early backward) or gpipe schedule."""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from ..core.dist import barrier, bounded, first_line, group_timeout, timeout_seconds, wait_for
from ..core.plan import Plan
from ..core.schedule import Op
from ..core.split_concat import slice_bounds
from ..profiler.export_graph import retarget_devices
from ..profiler.fx_trace import LeafSpec
from ..profiler.layers import arity, trace_layers
from .batchnorm import commit, defer_batch_norms, gather_sums, stats_size
from .distributed import DistContext, init_distributed
from .groups import GradGroup, GradReducer, canonical_names, make_grad_groups
from .p2p import P2P, PipelineError
from .program import LOOKAHEAD, Instr, Layout, Transfer, cut_routes, op_receives, rank_program
from .shapes import BoundaryShapes, Spec, input_key
from .stages import StageGraph, resolve_output, split_stages, state_names
from .tracing import KEEP_STEPS, Recorder, Trace, gather_trace, start_recorder
from .tracing import _write as _write_trace
from .validate import as_tuple, check_batch, check_plan, check_same_inputs, layout_mismatch


class _MicroBatch:
    """What one micro-batch keeps alive on a stage between its forward and its backward."""

    __slots__ = ("leaves", "sent", "loss")

    def __init__(self, leaves: list[torch.Tensor], sent: list[torch.Tensor], loss: torch.Tensor | None):
        self.leaves = leaves  # received boundary values (autograd leaves), in ``StageGraph.recv`` order
        self.sent = sent  # boundary values sent on, in ``StageGraph.send`` order (their graph is kept)
        self.loss = loss  # last stage: the slice loss, scaled by rows / global batch


class Pipeline:
    """This rank's replica of one stage of ``plan``; see :func:`dapple.pipeline`."""

    def __init__(self, model: nn.Module, plan: Plan, loss_fn: Callable[..., torch.Tensor], timeout: float = 60.0,
                 *, concrete_args: dict[str, Any] | None = None, leaf_modules: LeafSpec = (),
                 backend: str | None = None, tracer: str = "auto", example_inputs: Any = None,
                 dynamic_shapes: Any = None, trace: bool = False, deferred_batch_norm: bool = False):
        if not callable(loss_fn):
            raise TypeError(f"loss_fn: expected a callable (output, *targets) -> scalar, got {loss_fn!r}")
        timeout = timeout_seconds("timeout", timeout)
        if not isinstance(trace, bool):
            raise TypeError(f"trace: expected True or False (record a timeline of each step), got {trace!r}; the "
                            f"choice between torch.fx and torch.export is tracer='auto'|'fx'|'export'")
        if not isinstance(deferred_batch_norm, bool):
            raise TypeError(f"deferred_batch_norm: expected True or False, got {deferred_batch_norm!r}")
        self.timeout = timeout
        self.ctx: DistContext = init_distributed(self.timeout, backend)
        check_plan(plan, self.ctx.world_size)
        local = os.environ.get("LOCAL_WORLD_SIZE")
        mismatch = layout_mismatch(plan, int(local) if local and local.isdigit() else None)
        if mismatch and self.ctx.rank == 0:
            warnings.warn(f"dapple.pipeline: {mismatch}", stacklevel=3)
        lg = trace_layers(model, concrete_args=concrete_args, leaf_modules=leaf_modules, method=tracer,
                          example_inputs=example_inputs, dynamic_shapes=dynamic_shapes)
        plan.check_layers(lg.names)
        self.plan, self.loss_fn = plan, loss_fn
        graphs = split_stages(lg, [s.layers for s in plan.stages])  # every stage; only ours is kept below
        # deferred BatchNorm: each stage's slot in the vector of the loss AllReduce (every rank knows them all)
        sizes = [stats_size(g.module) if deferred_batch_norm else 0 for g in graphs]
        if deferred_batch_norm and stats_size(model) and not sum(sizes):
            raise ValueError("deferred_batch_norm=True: the model's BatchNorm layers are not modules of the traced "
                             "graph (torch.export inlines them); use tracer='fx'")
        rank = self.ctx.rank
        self.stage = plan.stage_of_device(rank)
        self.replica = plan.stages[self.stage].devices.index(rank)
        self.graph: StageGraph = graphs[self.stage]
        self.module: nn.Module = self.graph.module.to(self.ctx.device)
        if "dapple_trace" in lg.gm.meta and isinstance(self.module, fx.GraphModule):  # torch.export graphs
            self.module.meta["dapple_trace"] = dict(lg.gm.meta["dapple_trace"])  # bake in the traced device:
            retarget_devices(self.module, self.ctx.device)  # point arange(..., device=) etc. at ours
        self._bns = defer_batch_norms(self.module) if deferred_batch_norm else []  # same tensors, same names
        self._bn_slot = slice(1 + sum(sizes[:self.stage]), 1 + sum(sizes[:self.stage + 1]))
        self._reduced = 1 + sum(sizes)  # the loss, then every stage's BatchNorm statistics
        # every name each of this stage's tensors has in any stage's state_dict, and all those names in order
        # (checkpoints map tensors by them; the other stages' modules are dropped below)
        self.state_names, self.state_order = state_names(graphs, self.module)
        self._names = canonical_names(model)
        placeholders = [n for n in lg.gm.graph.nodes if n.op == "placeholder"]
        self._input_names = [n.name for n in placeholders]
        self._defaults = {n.name: n.args[0] for n in placeholders if n.args}  # forward(x, mask=None): mask
        self._arity = arity(lg.gm)
        self._boundary = [g.send for g in graphs[:-1]]  # value names crossing each cut
        self._shapes = BoundaryShapes(lg.gm, self._input_names, self._boundary)  # keeps a meta copy only
        self._layers = f"[{plan.stages[self.stage].layers[0]}, {plan.stages[self.stage].layers[1]})"  # for notes
        self._rows = slice_bounds(plan.micro_batch_size, plan.stages[self.stage].replicas)[self.replica]
        self._programs: dict[Layout, tuple[list[Instr], dict]] = {}
        self.step = 0
        self._failed: str | None = None
        # Process groups, created in the same order on every rank: gradient P2P channel, then AllReduce groups.
        where = f"rank {rank} (stage {self.stage}): dapple.pipeline"
        grad_p2p = bounded(self.timeout, f"{where}: creating the gradients' group of every rank (does every rank "
                           f"call dapple.pipeline with the same plan?)", dist.new_group,
                           list(range(self.ctx.world_size)),
                           timeout=group_timeout(self.timeout, self.ctx.backend)) \
            if plan.num_stages > 1 else None
        self._groups: list[GradGroup] = make_grad_groups(plan, graphs, self._names, rank, self.timeout, where)
        self._reducer = GradReducer(self._groups)
        self._p2p = P2P(rank, plan.stage_of_device, None, grad_p2p, self.timeout, self._value_name)
        self._handshake()
        self._rec: Recorder | None = None  # tracing: None (off) or the recorder the steps log into
        self._own_rec: Recorder | None = start_recorder(self, KEEP_STEPS) if trace else None
        self._rec = self._own_rec

    # ---- public -------------------------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's stage parameters (each once): give them to any torch optimizer."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name in the original model, parameter); a tied parameter has its first name there (``wte.weight``)."""
        for p in self.module.parameters():
            yield self._names[id(p)], p

    def train_step(self, inputs: torch.Tensor | Sequence[torch.Tensor],
                   targets: torch.Tensor | Sequence[torch.Tensor]) -> float:
        """One synchronous iteration on the GLOBAL batch (identical on every rank); returns its mean loss.

        Afterwards each parameter's ``.grad`` holds (plus whatever it held before) exactly the gradient of
        single-device training on the whole batch: slice losses scaled by rows / global batch, accumulated
        over micro-batches, summed over replicas and over stages sharing a tied parameter.
        """
        if self._failed:
            raise PipelineError(f"rank {self.ctx.rank}: this pipeline failed in an earlier step and its process "
                                f"groups are unusable; restart the job ({self._failed})")
        xs, ys = as_tuple(inputs, "inputs"), as_tuple(targets, "targets")
        check_batch(self.plan, xs, ys, self._arity)
        try:  # a ValueError here is every rank's, with nothing in flight: no step ran, the pipeline is usable
            check_same_inputs(input_key(xs), self.ctx.device, self.timeout,
                              f"rank {self.ctx.rank} (stage {self.stage}), step {self.step + 1}")
        except PipelineError as e:
            self._failed = first_line(e)
            raise
        self.step += 1
        self._p2p.step = self.step
        try:
            return self._run(xs, ys)
        except BaseException as e:
            self._failed = first_line(e)
            raise

    def trace(self) -> Trace:
        """Record the steps run inside ``with pipe.trace() as t:`` (enter on every rank; it syncs clocks), then
        ``t.save("trace.json")`` on every rank: one Chrome trace of all ranks, written by rank 0. Steps in the
        block are recorded there only (not also by a ``trace=True`` pipeline's own recorder)."""
        return Trace(self)

    def save_trace(self, path: str | os.PathLike) -> Path | None:
        """With ``pipeline(..., trace=True)``: write the last recorded steps (up to 16) of all ranks as one
        Chrome trace on rank 0 (collective: call on every rank); returns the path on rank 0, else None."""
        if self._own_rec is None:
            raise RuntimeError("save_trace: this pipeline does not record steps; create it with "
                               "dapple.pipeline(..., trace=True), or use 'with pipe.trace() as t: ...; t.save(path)'")
        return _write_trace(gather_trace(self, self._own_rec), path)

    def __repr__(self) -> str:
        s = self.plan.stages[self.stage]
        return (f"Pipeline(rank={self.ctx.rank}, stage={self.stage}/{self.plan.num_stages}, replica={self.replica}"
                f"/{s.replicas}, layers=[{s.layers[0]}, {s.layers[1]}), device={self.ctx.device}, "
                f"schedule={self.plan.schedule}, K={s.warmup})")

    # ---- one step -----------------------------------------------------------------------------
    def _run(self, xs: tuple[torch.Tensor, ...], ys: tuple[torch.Tensor, ...]) -> float:
        key = input_key(xs)
        layout = self._layout(key)
        program, waits = self._program(layout)
        stash = {p: p.grad for p in self.module.parameters()}  # earlier gradients: added back at the end
        for p in stash:
            p.grad = None
        alive: dict[int, _MicroBatch] = {}
        outbox: list[torch.Tensor | None] = []
        # reduced over all ranks at the end: the loss (the last stage's replicas add theirs), then every stage's
        # deferred BatchNorm sums in its slot (zeros elsewhere), so one AllReduce sums them over the replicas
        reduced = torch.zeros(self._reduced, dtype=torch.float64, device=self.ctx.device)  # (1 + all stages' sizes,)
        loss_sum = reduced[0]  # a view: += adds into ``reduced``
        rec = self._p2p.rec = self._reducer.rec = self._rec  # tracing: one `is not None` test per instruction
        if rec is not None:
            rec.begin_step(self.step)
        n_recv, n_send = len(self.graph.recv), len(self.graph.send)
        for ins in program:
            t = ins.transfer
            if ins.action == "recv":
                spec = self._spec(key, t)
                self._p2p.post_recv(t, torch.empty(spec.shape, dtype=spec.dtype, device=self.ctx.device))
            elif ins.action == "send":
                lo = t.start - self._rows[0]  # rows of this rank's slice that the route covers
                self._p2p.send(t, self._checked(outbox[t.value][lo:lo + t.rows], self._spec(key, t), t))
            elif ins.op.kind == "F":
                pieces = self._gather(ins.op, waits[ins.op], n_recv, rec)
                start = rec.clock() if rec is not None else 0.0
                outbox = self._forward(ins.op.micro_batch, pieces, xs, ys, alive, layout)
                if alive[ins.op.micro_batch].loss is not None:
                    loss_sum += alive[ins.op.micro_batch].loss.detach()
                if rec is not None:
                    rec.compute("F", ins.op.micro_batch, start, rec.clock())
            else:
                pieces = self._gather(ins.op, waits[ins.op], n_send, rec)
                start = rec.clock() if rec is not None else 0.0
                if ins.op.micro_batch == self.plan.num_micro_batches - 1:  # the last backward of the step
                    self._reducer.arm()  # gradient AllReduce buckets start as their gradients become final
                outbox = self._backward(ins.op.micro_batch, pieces, alive, layout)
                if rec is not None:
                    rec.compute("B", ins.op.micro_batch, start, rec.clock())
        start = rec.clock() if rec is not None else 0.0
        self._p2p.finish()
        if rec is not None:
            rec.idle(start, rec.clock(), "sends to complete")
        where = f"rank {self.ctx.rank} (stage {self.stage}), step {self.step}"
        self._reducer.finish(self.timeout, where)
        start = rec.clock() if rec is not None else 0.0
        if self._bns:
            reduced[self._bn_slot] = gather_sums(self._bns, where)
        wait_for(dist.all_reduce(reduced, async_op=True), self.timeout, f"{where}: loss AllReduce over all ranks")
        commit(self._bns, reduced[self._bn_slot])
        if rec is not None:
            rec.idle(start, rec.clock(), "loss AllReduce (all ranks)")
        for p, old in stash.items():
            if old is not None:
                p.grad = old if p.grad is None else p.grad.add_(old)
        if rec is not None:
            rec.end_step()
        return float(reduced[0])

    def _forward(self, j: int, pieces: list[list[torch.Tensor]], xs: tuple[torch.Tensor, ...],
                 ys: tuple[torch.Tensor, ...], alive: dict[int, _MicroBatch], layout: Layout
                 ) -> list[torch.Tensor | None]:
        g, b = self.graph, self.plan.micro_batch_size
        lo, hi = j * b + self._rows[0], j * b + self._rows[1]  # this replica's rows of the global batch
        env: dict[str, Any] = {}
        for name in g.inputs:
            i = self._input_names.index(name)
            env[name] = xs[i][lo:hi].to(self.ctx.device, non_blocking=True) if i < len(xs) else self._defaults[name]
        leaves: list[torch.Tensor] = []
        if self.stage > 0:  # concat: the pieces of each value from the senders whose slices overlap ours
            grads = set(layout.grads[self.stage - 1])
            for v, name in enumerate(g.recv):
                x = pieces[v][0] if len(pieces[v]) == 1 else torch.cat(pieces[v])  # (rows, ...)
                leaves.append(x.requires_grad_(v in grads))
                env[name] = x.clone() if name in g.modified and x.requires_grad else x  # leaves stay intact
        with self._noted(j, lambda: f"in the forward of layers {self._layers}"):
            outs = self.module(*[env[a] for a in g.args])
        env.update(zip(g.outs, outs))
        if self.stage == self.plan.num_stages - 1:
            out = resolve_output(g.output, env)
            tgt = [y[lo:hi].to(self.ctx.device, non_blocking=True) for y in ys]
            with self._noted(j, lambda: f"in loss_fn(output {_shape(out)}, *targets {[_shape(t) for t in tgt]})"):
                loss = self.loss_fn(out, *tgt)  # the user's function: its error, and with what it was called
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"{self._where(j)}: loss_fn must return a scalar tensor (the mean over the rows it "
                                f"is given), got {loss!r:.80}")
            alive[j] = _MicroBatch(leaves, [], loss.reshape(()) * ((hi - lo) / self.plan.global_batch_size))
            return []
        sent = [env[name] for name in g.send]
        alive[j] = _MicroBatch(leaves, sent, None)
        return sent

    def _backward(self, j: int, pieces: list[list[torch.Tensor]], alive: dict[int, _MicroBatch], layout: Layout
                  ) -> list[torch.Tensor | None]:
        m = alive.pop(j)  # dropping it after this backward frees the micro-batch's activations
        with self._noted(j, lambda: f"in the backward of layers {self._layers}"):
            if m.loss is not None:
                if m.loss.requires_grad:
                    m.loss.backward()
            else:
                roots, grads = [], []
                for v in layout.grads[self.stage]:  # split: gradients come back along the routes they went
                    g = pieces[v][0] if len(pieces[v]) == 1 else torch.cat(pieces[v])
                    if m.sent[v].requires_grad:
                        roots.append(m.sent[v])
                        grads.append(g.to(m.sent[v].dtype))
                if roots:
                    torch.autograd.backward(roots, grads)
        if self.stage == 0:
            return []
        out: list[torch.Tensor | None] = []
        for v, leaf in enumerate(m.leaves):
            if v in layout.grads[self.stage - 1]:
                out.append(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
            else:
                out.append(None)
        return out

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
            raise PipelineError(f"rank {self.ctx.rank} (stage {self.stage}), step {self.step}: {self._value_name(t)} "
                                f"of micro-batch {t.micro_batch} has shape {tuple(x.shape)} but shape inference "
                                f"(meta device) gave {spec.shape}; the model's shapes must not depend on values")
        return x if x.dtype == spec.dtype else x.to(spec.dtype)  # e.g. under autocast (meta runs without it)

    def _gather(self, op: Op, recvs: list[Transfer], count: int, rec: Recorder | None) -> list[list[torch.Tensor]]:
        """Wait for an op's receives; per value, the pieces in row order (routes are sorted by rows)."""
        pieces: list[list[torch.Tensor]] = [[] for _ in range(count)]
        start = rec.clock() if rec is not None and recvs else 0.0
        for t in recvs:
            pieces[t.value].append(self._p2p.wait_recv(t))
        if rec is not None and recvs:
            rec.idle(start, rec.clock(), op)
        return pieces

    # ---- plans for the communication ------------------------------------------------------------
    def _layout(self, key: tuple) -> Layout:
        specs = self._shapes.specs(key, self.plan.micro_batch_size)
        return Layout(values=tuple(len(c) for c in specs),
                      grads=tuple(tuple(v for v, sp in enumerate(c) if sp.requires_grad) for c in specs))

    def _program(self, layout: Layout) -> tuple[list[Instr], dict]:
        if layout not in self._programs:
            prog = rank_program(self.plan, layout, self.ctx.rank, receive_lookahead(self.ctx.device))
            self._programs[layout] = (prog, op_receives(prog, self.ctx.rank, self.plan, layout))
        return self._programs[layout]

    def _spec(self, key: tuple, t: Transfer) -> Spec:
        return self._shapes.specs(key, t.rows)[t.cut][t.value]

    def _value_name(self, t: Transfer) -> str:
        return f"value {self._boundary[t.cut][t.value]!r}"

    def _handshake(self) -> None:
        """One tiny message on every channel this rank uses, in a global order, before the first step.

        Checks that every peer is reachable (bounded by the timeout) and, on NCCL, creates each pair's
        communicator in an order that cannot deadlock, so the schedule's early receives never block on it.
        """
        plan, rank = self.plan, self.ctx.rank
        channels = set()
        for c in range(plan.num_stages - 1):
            for _, src, dst in cut_routes(plan, c):
                channels.add((src, dst, "act"))
                channels.add((dst, src, "grad"))
        mine = []
        for ch in sorted(channels):
            if rank in ch[:2]:
                t = Transfer(ch[2], -1, -1, 0, ch[0], ch[1], 0, 1)
                buf = torch.zeros(1, device=self.ctx.device)
                if rank == ch[0]:
                    self._p2p.send(t, buf)
                else:
                    self._p2p.post_recv(t, buf)
                    mine.append(t)
        for t in mine:
            self._p2p.wait_recv(t)
        self._p2p.finish()
        for g in self._groups:
            barrier(self.ctx.device, self.timeout, f"rank {rank} (stage {self.stage}): reaching the ranks {g.ranks} "
                    f"of the {g.label} group", g.group)


def receive_lookahead(device: torch.device) -> int:
    """How many ops ahead a rank posts its receives: :data:`LOOKAHEAD` where a receive waits on the host (gloo),
    none on CUDA. There a posted NCCL receive is a kernel that spins until its data comes, and a lazily loaded
    kernel (CUDA_MODULE_LOADING=LAZY, torch's default) or a host sync of the same rank waits for it; if the data
    depends on work the rank has yet to launch, that is a deadlock. Measured on an H100 (NCCL 2.28, 2 stages,
    1 micro-batch): stage 0 posted the receive of micro-batch 0's gradients before its first forward, whose
    kernels loaded lazily, and both ranks hung until the timeout. Just in time, the receive is waited on as soon
    as it is posted (torch.distributed.pipelining does the same); sends still go out as soon as they are made."""
    return 0 if device.type == "cuda" else LOOKAHEAD


def pipeline(model: nn.Module, plan: Plan, loss_fn: Callable[..., torch.Tensor], timeout: float = 60.0, *,
             concrete_args: dict[str, Any] | None = None, leaf_modules: LeafSpec = (),
             backend: str | None = None, tracer: str = "auto", example_inputs: Any = None,
             dynamic_shapes: Any = None, trace: bool = False, deferred_batch_norm: bool = False) -> Pipeline:
    """Run ``model`` as planned: this rank keeps only its stage and trains it with ``train_step``.

    Call on every rank (e.g. under ``torchrun --nproc_per_node=N``) with the same model, plan and loss;
    the default process group is initialised from torchrun's environment if needed (NCCL and
    ``cuda:LOCAL_RANK`` when CUDA is available, gloo on the CPU otherwise). ``loss_fn(output, *targets)``
    must return the mean loss over the rows it is given. ``timeout`` (seconds) bounds every receive and
    collective: a dead or stuck peer makes the others raise :class:`PipelineError` naming rank, stage,
    peer and micro-batch. ``concrete_args``/``leaf_modules``/``tracer``/``example_inputs``/``dynamic_shapes``
    go to the tracer exactly as for :func:`dapple.profile` (use the same values, so the layers match the
    plan's): a model torch.fx cannot trace is traced with torch.export when ``example_inputs`` are given.
    ``trace=True`` records a timeline of every step (the last 16 are kept; ``pipe.save_trace(path)`` on every
    rank writes them as one Chrome trace); ``with pipe.trace() as t:`` records just the steps in a block.
    ``deferred_batch_norm=True`` (torch.fx graphs): BatchNorm layers normalise each slice by its own statistics
    as always, but update their running statistics once per step, with those of every row they saw in it
    (all micro-batches and replicas: the global batch), so every replica of a stage holds the same; otherwise
    each replica updates its own per slice, and they drift apart.
    """
    return Pipeline(model, plan, loss_fn, timeout, concrete_args=concrete_args, leaf_modules=leaf_modules,
                    backend=backend, tracer=tracer, example_inputs=example_inputs, dynamic_shapes=dynamic_shapes,
                    trace=trace, deferred_batch_norm=deferred_batch_norm)


def _shape(x: Any) -> Any:
    """A tensor's shape as a tuple (for messages); anything else as its type name."""
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
