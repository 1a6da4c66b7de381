"""The Pipeline: one stage replica per rank, built from a plan and trained step by step (dapple or gpipe schedule)."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from ..core.checks import flag, number
from ..core.dist import first_line, timeout_seconds
from ..core.meta import InitFn, check_init_fn
from ..core.plan import Plan, Recompute
from ..core.schedule import SPLIT_BACKWARD
from ..core.split_concat import slice_bounds
from ..profiler.fx_trace import LeafSpec
from ..profiler.layers import trace_layers
from ..profiler.trace_options import traced_as
from .agreement import agree, describe, failures_told
from .batch_check import BatchCheck
from .batchnorm import stage_stats_sizes, stats_slot
from .channels import handshake, open_channels
from .chunk import StageChunk, StepState
from .clipping import clip_grad_norm, counted_parameters, norm_group
from .compiling import stage_compiler
from .data import RankData, StepBatch, rank_data
from .distributed import DistContext, init_distributed
from .groups import canonical_names
from .meta_stage import materialise_stage
from .modes import eval_graph
from .p2p import PipelineError
from .precision import LossScaler, Precision, allreduce_dtype
from .program import Transfer
from .rank_batch import rank_batch
from .recompute import check_recomputable, layered_module, recomputing
from .replan import StateMove, Switch, check_replan, close_groups, rebuild_args
from .shapes import BoundaryShapes
from .stages import StageGraph, layer_paths, model_inputs, node_places, rank_module, split_stages, stage_module
from .state import LoadResult, held_keys, load_state, model_keys, own_tensors, stage_keys, state_names
from .step import StepRunner
from .tracing import KEEP_STEPS, Recorder, Trace, gather_trace, start_recorder, write_trace
from .validate import check_plan, layout_mismatch

Batch = Union[torch.Tensor, Sequence[Optional[torch.Tensor]], Mapping[str, torch.Tensor], None]  # inputs, targets


class Pipeline:
    """This rank's replica of one stage of ``plan``; see :func:`dapple.pipeline`.

    Attributes: ``plan``, ``loss_fn``, ``timeout``; ``ctx`` (rank, world size, backend, device); ``stage`` and
    ``replica`` (this rank's place in the plan); ``data`` (what it reads of each batch: :class:`RankData`);
    ``graph`` and ``module`` (the stage's computation); ``global_step`` (training steps run; ``step`` is an
    alias); ``training`` (the mode:
    :meth:`train`, :meth:`eval`); ``state_names`` (id(tensor) -> its keys in the original model's state_dict) and
    ``state_order`` (the model's keys some stage holds, in order), for :meth:`state_dict` and checkpoints;
    ``recorder`` (where steps are traced; None: off).
    """

    def __init__(self, model: nn.Module, plan: Plan, loss_fn: Callable[..., torch.Tensor], timeout: float = 60.0,
                 *, concrete_args: dict[str, Any] | None = None, leaf_modules: LeafSpec | None = None,
                 backend: str | None = None, tracer: str | None = None, example_inputs: Any = None,
                 dynamic_shapes: Any = None, trace: bool = False, deferred_batch_norm: bool = False,
                 layers: Sequence[str] | None = None, check_inputs: bool = True,
                 mixed_precision: str | None = None, recompute: Recompute | Sequence[Recompute] | None = None,
                 reduce_dtype: str | None = None, compile: bool | Mapping[str, Any] = False,
                 init_fn: InitFn | None = None):
        # what replan() builds another plan's pipeline from: the same options, the model's structure (no data)
        self._rebuild = rebuild_args({k: v for k, v in locals().items() if k not in ("self", "plan", "__class__")})
        self.timeout = _checked_options(loss_fn, timeout, trace, deferred_batch_norm)
        check_init_fn(init_fn)
        flag("check_inputs", check_inputs, "compare a checksum of each step's batch across ranks")
        self.check_inputs = check_inputs
        # (a plan that is no Plan: check_plan names it below)
        precision = Precision.of(plan.precision(mixed_precision) if isinstance(plan, Plan) else mixed_precision)
        self.ctx: DistContext = init_distributed(self.timeout, backend)
        # a rank that fails from here on tells the others, waiting to agree, which and why
        with failures_told(self.ctx.rank, self.ctx.world_size, self.ctx.device, self.timeout):
            check_plan(plan, self.ctx.world_size)
            wire = allreduce_dtype(plan, reduce_dtype)  # the gradient AllReduce's dtype (None: the gradients')
            self.scaler = LossScaler(precision.dtype == torch.float16)  # fp16: dynamic loss scaling
            if plan.mixed_precision and precision.name != plan.mixed_precision and self.ctx.rank == 0:
                warnings.warn(f"dapple.pipeline: mixed_precision={mixed_precision!r} but the plan was made for "
                              f"{plan.mixed_precision or 'full precision'}: its memory and time estimates assume that "
                              f"(plan with mixed_precision={precision.name!r} to match)", stacklevel=3)
            local = os.environ.get("LOCAL_WORLD_SIZE")
            mismatch = layout_mismatch(plan, int(local) if local and local.isdigit() else None)
            if mismatch and self.ctx.rank == 0:
                warnings.warn(f"dapple.pipeline: {mismatch}", stacklevel=3)
            # traced as the plan's profile was (plan.tracing), but for what the caller gives
            traced = traced_as(plan.tracing, model, tracer=tracer, concrete_args=concrete_args,
                               leaf_modules=leaf_modules, example_inputs=example_inputs, dynamic_shapes=dynamic_shapes)
            lg = trace_layers(model, **traced, layers=layer_paths(model, plan, layers))
            plan.check_layers(lg.names)
            self.plan, self.loss_fn = plan, loss_fn
            graphs = split_stages(lg, [s.layers for s in plan.stages])  # every stage; only ours are kept below
            flags = recomputing(plan, recompute)
            for i in (i for i, on in enumerate(flags) if on):  # every rank checks every stage: all raise alike
                check_recomputable(graphs[i].module, i)
            self._compiler = stage_compiler(compile, plan.schedule, flags)  # None: eager
            # this rank's stages: one, or its device group's chunks (the first names the rank in messages)
            self.stages: list[int] = plan.stages_of_device(self.ctx.rank)
            self.stage, self.recompute = self.stages[0], flags[self.stages[0]]
            self.replica = plan.stages[self.stage].devices.index(self.ctx.rank)
            self.graph: StageGraph = graphs[self.stage]
            self.who = f"rank {self.ctx.rank} ({plan.device_label(self.ctx.rank)})"  # for messages
            # the stage's module, or a module holding every chunk's (parameters, state_dict, train/eval: all of them)
            self.module: nn.Module = rank_module([graphs[s].module for s in self.stages], self.stages)
            by_key = stage_keys(self.module, model_keys(model))  # before buffers move to the device
            order = held_keys(model, [g.module for g in graphs])
            # a meta-device model: only this rank's stages become real, on its device (ids change: names come after)
            materialise_stage(model, lg, graphs, self.stages, self.ctx.device, init_fn, f"{self.who}: dapple.pipeline")
            for s in self.stages:
                stage_module(graphs[s], lg.gm, self.ctx.device)  # (in place: ``self.module`` holds it)
            # the model's state_dict keys of each of this rank's tensors, and all its keys in order (state_dict,
            # checkpoints; the other stages' modules are dropped below)
            self._state = state_names(self.module, by_key, order)
            self.state_names, self.state_order = self._state.names, self._state.order
            self._names = canonical_names(model)
            inputs = model_inputs(lg.gm)
            self._arity = inputs.arity
            readers = [[s for s, g in enumerate(graphs) if name in g.inputs] for name in inputs.names]
            self.data: RankData = rank_data(plan, self.ctx.rank, readers, inputs.names)
            self._batch_check = BatchCheck(self.data, plan, inputs.arity, self.ctx.device, self.timeout)
            self._boundary = [g.send for g in graphs[:-1]]  # value names crossing each cut
            places = node_places(lg, [s.layers for s in plan.stages])  # for shape inference's errors
            cuts = [(lg.names[s.layers[1] - 1], lg.names[s.layers[1]]) for s in plan.stages[:-1]]  # for errors
            shapes = BoundaryShapes(lg.gm, inputs.names, self._boundary, places, cuts)  # keeps a meta copy only
        self.global_step = 0  # training steps run (checkpoints save it, load_checkpoint sets it)
        self._failed: str | None = None
        # every rank was given the same plan, model and options: one small AllReduce, before any group or transfer
        agree(describe(plan, model, lg.names, inputs.names, precision=precision.name, recompute=flags, loss_fn=loss_fn,
                       options={"deferred_batch_norm": deferred_batch_norm, "check_inputs": check_inputs,
                                "tracer": traced["tracer"], "reduce_dtype": wire,
                                "compile": None if self._compiler is None else self._compiler.describe()}),
              self.ctx.rank, self.ctx.world_size, self.ctx.device, self.timeout)
        # Process groups, created in the same order on every rank: gradient P2P channel, then AllReduce groups.
        channels = open_channels(plan, graphs, self._names, self.ctx, self.who, self.timeout, self.value_name,
                                 reduce_dtype=wire)
        self._p2p, self._reducer, self._groups = channels.p2p, channels.reducer, channels.groups
        self._counted: list[nn.Parameter] | None = None  # clip_grad_norm_'s share of the norm (on first use)
        self._norm_group: dist.ProcessGroup | None = None  # and the group of its AllReduce
        state = StepState(plan, self.ctx, loss_fn, inputs, precision, self.scaler)
        chunks = self._chunks(state, model, graphs, flags, deferred_batch_norm)
        for c in chunks:
            if c.recompute == "layers":  # (a stage's module is a graph: split_stages)
                c.train_module = layered_module(graphs[c.stage].module, {n.name: k for n, k in lg.layer_of.items()})
        self._runner = StepRunner(state, chunks, shapes, channels, self.timeout)
        self.training = bool(model.training)  # the model's mode; pipe.train() / pipe.eval() change it
        self._eval_modules: dict[int, nn.Module] = {}  # made on the first eval(): each stage with training flags off
        self._set_forward_modules()
        handshake(plan, self.ctx, self.who, channels, self.timeout)
        self._own_rec: Recorder | None = start_recorder(self, KEEP_STEPS) if trace else None
        self.recorder: Recorder | None = self._own_rec  # tracing: None (off) or the recorder the steps log into

    def _chunks(self, state: StepState, model: nn.Module, graphs: Sequence[StageGraph], recompute: list[Recompute],
                deferred_batch_norm: bool) -> list[StageChunk]:
        """This rank's stages as the step runs them, each with its deferred BatchNorms' slot (every rank knows every
        stage's, so the vector of the loss AllReduce is laid out alike everywhere)."""
        plan = self.plan
        sizes = stage_stats_sizes(model, [g.module for g in graphs], deferred_batch_norm)
        rows = slice_bounds(plan.micro_batch_size, plan.stages[self.stage].replicas)[self.replica]
        split = plan.schedule in SPLIT_BACKWARD  # a recomputing stage runs its whole backward in B
        return [StageChunk(state, s, graphs[s], graphs[s].module, rows,
                           stats_slot(graphs[s].module, sizes, s, deferred_batch_norm),  # same tensors, same names
                           recompute=recompute[s], split=split and not recompute[s]) for s in self.stages]

    # ---- public -------------------------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, of its stage or of every chunk it holds (each once): give them to any torch
        optimizer."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name in the original model, parameter); a tied parameter has its first name there (``wte.weight``)."""
        for p in self.module.parameters():
            yield self._names[id(p)], p

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The process group of this stage's replicas (the one its gradient AllReduce runs on), or None where the
        stage has one replica: what :func:`dapple.shard_optimizer` shards the optimizer state over."""
        return next((g.group for g in self._groups if not g.spans_stages), None)

    @property
    def step(self) -> int:
        """Alias of :attr:`global_step`, the number of training steps run."""
        return self.global_step

    @step.setter
    def step(self, value: int) -> None:
        self.global_step = value

    def rows(self, batch_size: int | None = None) -> list[int]:
        """The global-batch row indices this rank reads, in the order of its compact batch (``[]`` where it reads
        nothing): ``self.data.rows``; :class:`DistributedPipelineSampler` loads them from a dataset.

        Args:
            batch_size: the batch's rows (default: the plan's global batch).
        """
        return self.data.rows(batch_size)

    def train_step(self, inputs: Batch = None, targets: Batch = None, batch_size: int | None = None,
                   ids: Any = None) -> float:
        """One synchronous iteration on the global batch (call on every rank).

        Each rank passes the global batch (identical on every rank), or only what it reads: its own rows
        (:meth:`rows`, in that order) of the inputs its stage reads, ``None`` for the others (a sequence with
        ``None`` in place of an input it does not read, or ``None`` for all), and the targets' rows on the last
        stage, ``None`` elsewhere. A tensor's rows tell its layout: the global batch's, or this rank's own; where
        they are the same number (a stage that is not replicated), they are the same rows. Ranks may mix layouts.

        Afterwards each parameter's ``.grad`` holds (plus whatever it held before) exactly the gradient of
        single-device training on the whole batch: slice losses scaled by rows / global batch, accumulated
        over micro-batches, summed over replicas and over stages sharing a tied parameter.

        Args:
            inputs: the model's positional inputs (a tensor or a sequence of tensors), or its inputs by name (a
                dict or ``BatchEncoding`` of ``forward``'s arguments, passed by keyword: trace the model with them
                so, e.g. a plan from ``dapple.profile(model, {"input_ids": ..., "attention_mask": ...})``); each
                the global batch or this rank's rows in dim 0; None (or left out) where the rank does not read it.
            targets: the loss's targets (a tensor or a sequence of tensors), the same rows; None where the rank
                does not compute the loss.
            batch_size: the global batch's rows, if given (what :func:`pipeline_loader` yields third): must be
                ``plan.global_batch_size``.
            ids: optional, the dataset row of each row given (a 1-D integer tensor or sequence, of the global
                batch's rows or this rank's own; :func:`pipeline_loader` yields it fourth): ranks that hold the
                same batch rows must have loaded the same dataset rows (with ``check_inputs``).

        Returns:
            The step's mean loss over the global batch.

        Raises:
            ValueError, TypeError: a batch that does not fit the model or plan, or ranks whose batches disagree
                (:class:`BatchCheck`): every rank raises, nothing ran; or a wrong loss (the sum over the rows, or
                no gradient): every rank raises once the step's collectives completed, its gradients discarded.
                Either way the pipeline stays usable.
            PipelineError: a peer failed or timed out; the pipeline is unusable afterwards (as after any error
                raised while the step's transfers were in flight, e.g. in the model).
        """
        batch = self._checked_batch(inputs, targets, f"step {self.global_step + 1}", batch_size, ids)
        self.global_step += 1
        try:
            return self._runner.run(batch, self.global_step, self.recorder)
        except BaseException as e:
            self._poison_unless_settled(e)
            raise

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> float:
        """Clip the gradients of the whole model by their global norm, as ``torch.nn.utils.clip_grad_norm_`` does
        on one device; call it on every rank after ``train_step``.

        The norm is over every stage, a stage's replicas and the stages sharing a tied parameter counted once.

        Args:
            max_norm: the largest total norm the gradients keep.
            norm_type: the norm's order (``float("inf")``: the largest absolute entry).
            error_if_nonfinite: raise RuntimeError when the total norm is NaN or infinite.

        Returns:
            The total norm before clipping, the same on every rank.

        Raises:
            PipelineError: a rank did not clip within the timeout (the message names it and where it is); the
                pipeline is unusable afterwards.
        """
        number("max_norm", max_norm, finite=True)
        number("norm_type", norm_type, positive=True)
        who, moment = self.who, f"clip_grad_norm_ after step {self.global_step}"
        self._check_usable(moment)
        try:
            if self._norm_group is None:
                self._norm_group = norm_group(self.ctx.world_size, self.ctx.backend, self.timeout, who, moment)
                self._counted = counted_parameters(self.plan, self.stage, self.ctx.rank, list(self.parameters()),
                                                   self._groups)
            return clip_grad_norm(self._counted or [], list(self.parameters()), float(max_norm), float(norm_type),
                                  device=self.ctx.device, timeout=self.timeout, who=who, moment=moment,
                                  group=self._norm_group, error_if_nonfinite=error_if_nonfinite)
        except PipelineError as e:
            self._failed = first_line(e)
            raise

    def eval_step(self, inputs: Batch = None, targets: Batch = None, batch_size: int | None = None,
                  ids: Any = None, *, outputs: bool = False) -> float | tuple[float, list[tuple[range, Any]]]:
        """A pipelined forward-only pass under ``torch.no_grad`` (call on every rank): the mean loss over the batch,
        as ``loss_fn(model(inputs), *targets)`` of the model in the pipeline's mode (:meth:`eval` first for a
        validation loss: no dropout, BatchNorm's running statistics). No gradient, no step counted.

        Args:
            inputs: the model's inputs (positional, or by name as for :meth:`train_step`), a batch of any multiple
                of ``plan.micro_batch_size`` rows in dim 0 (identical on every rank), or, with ``batch_size``, this
                rank's rows of it
                (``rows(batch_size)``) and None where it does not read them, as for :meth:`train_step`.
            targets: the loss's targets, the same rows; None where the rank does not compute the loss.
            batch_size: the batch's rows (:func:`pipeline_loader` yields it third: ``eval_step(*batch)``); without
                it, every tensor given is read as the whole batch (a rank given none learns the size from the
                others), so a rank's own rows need it.
            ids: optional, the dataset row of each row given, as for :meth:`train_step`.
            outputs: also return this rank's model outputs.

        Returns:
            The mean loss (the same on every rank); with ``outputs``, ``(loss, slices)``: on the ranks of the last
            stage, one ``(rows, output)`` per micro-batch slice this replica computed (``rows``: a ``range`` of the
            batch's rows; ``output``: the model's output for them, as the model returns it), elsewhere ``[]``.

        Raises:
            ValueError, PipelineError: as :meth:`train_step`.
        """
        batch = self._checked_batch(inputs, targets, f"evaluation after step {self.global_step}", batch_size, ids, True)
        try:
            loss, kept = self._runner.evaluate(batch, self.global_step, outputs)
        except BaseException as e:
            self._poison_unless_settled(e)
            raise
        return (loss, kept) if outputs else loss

    def _checked_batch(self, inputs: Batch, targets: Batch, what: str, batch_size: int | None = None,
                       ids: Any = None, any_rows: bool = False) -> StepBatch:
        """The batch checked on this rank and against every other rank's (errors name the values; a rank's own
        error is raised on every rank, so none runs the step)."""
        self._check_usable(what)
        try:
            mine, error = rank_batch(self.data, self._arity, inputs, targets, batch_size, any_rows, ids), None
        except (TypeError, ValueError) as e:
            mine, error = None, e
        try:  # a ValueError here is every rank's, with nothing in flight: no step ran, the pipeline is usable
            return self._batch_check.check(mine, error, self.who, what,
                                           self.check_inputs)
        except PipelineError as e:
            self._failed = first_line(e)
            raise

    def _check_usable(self, what: str) -> None:
        """PipelineError if an earlier step left the process groups in an unknown state."""
        if self._failed:
            raise PipelineError(f"rank {self.ctx.rank}: {what}: this pipeline failed earlier while transfers or "
                                f"collectives were in flight, so its process groups are unusable; restart the job "
                                f"({self._failed})")

    def _poison_unless_settled(self, e: BaseException) -> None:
        """After an error in a step: unusable if its transfers or collectives may still be in flight (a peer
        failed, or this rank raised mid-step); usable if they all completed (e.g. a wrong loss, found after)."""
        if not self._runner.settled:
            self._failed = first_line(e)

    # ---- mode and state -------------------------------------------------------------------------
    def train(self, mode: bool = True) -> "Pipeline":
        """Training mode (dropout on, BatchNorm normalising by batch statistics and updating its running ones),
        or with ``mode=False`` evaluation mode, for this rank's stage: its modules' flags, and the flags the
        tracer baked into its ops (torch.export graphs, functional dropout). Returns the pipeline."""
        if not isinstance(mode, bool):
            raise TypeError(f"train: expected True or False, got {mode!r}")
        self.module.train(mode)
        self.training = mode
        self._set_forward_modules()
        return self

    def eval(self) -> "Pipeline":
        """Evaluation mode: ``train(False)``."""
        return self.train(False)

    def _set_forward_modules(self) -> None:
        """What runs each chunk's forwards in the current mode: the stage, or its evaluation twin; compiled if
        asked."""
        for c in self._runner.chunks.values():
            module = c.train_module if self.training else self._evaluation_module(c.stage, c.module)
            c.forward_module = module if self._compiler is None else self._compiler(module)

    def _evaluation_module(self, stage: int, module: nn.Module) -> nn.Module:
        if stage not in self._eval_modules:
            twin = eval_graph(module) if isinstance(module, torch.fx.GraphModule) else None
            self._eval_modules[stage] = twin if twin is not None else module
        self._eval_modules[stage].train(False)
        return self._eval_modules[stage]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stage's entries of the original model's ``state_dict``, under its keys (a tied parameter
        under each of its keys; no non-persistent buffer), in its order, detached."""
        return {k: t.detach() for k, t in own_tensors(self.module, self._state).items()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> LoadResult:
        """Copy ``state_dict`` (keys of the original model: this rank's :meth:`state_dict`, or the whole model's)
        into this rank's stage; entries of other stages are skipped.

        Args:
            state_dict: model key -> tensor.
            strict: raise a ValueError naming them if a key of this stage is missing or a key is not the model's.

        Returns:
            ``(missing_keys, unexpected_keys)``.
        """
        return load_state(self.module, self._state, state_dict, strict, self.who)

    def replan(self, plan: Plan, optimizer: torch.optim.Optimizer | None = None) -> Switch:
        """Continue under ``plan`` (call on every rank, between steps): this rank builds its stage of the new plan
        (from the model's structure, copied without data when the pipeline was made: it shares no tensor with the
        model given to :func:`dapple.pipeline`), every rank sends the parameters, buffers, gradients and
        ``optimizer`` state it holds to their owners under the new plan, in memory, and the old plan's process
        groups are closed. Training then goes on as if the new plan had run from the start with this state (as a
        checkpoint saved under one plan and loaded under the other). ``step``, fp16's loss scale and the mode carry
        over; what a rank reads of each batch follows the new plan (:meth:`rows`).

        Args:
            plan: the new plan, for the same model, world size and global batch.
            optimizer: an optimizer over :meth:`parameters` (on every rank, or none): rebuilt in place over the
                new stage's parameters, each in the param group it was in, with its state; an LR scheduler of it
                goes on working. Its param groups must be the same list on every rank.

        Returns:
            This rank's :class:`~dapple.runtime.replan.Switch`: the seconds it took (building, moving) and the
            bytes it sent and received.

        Raises:
            TypeError, ValueError: a bad plan or optimizer (every rank raises before anything changed).
            PipelineError: a peer failed or timed out.
        """
        self._check_usable("replan")
        check_replan(self, plan, optimizer, self._rebuild)
        move = StateMove(self, optimizer, time.perf_counter())  # collective: what every rank holds, checked
        new = Pipeline(plan=plan, **self._rebuild)
        switch = move.into(new)
        old = [self._p2p.groups["grad"], *(g.group for g in self._groups), self._norm_group]
        self._reducer.close()
        vars(self).clear()  # this object becomes the new plan's pipeline (callers keep their reference)
        vars(self).update(vars(new))
        close_groups(old)
        return switch

    def trace(self) -> Trace:
        """Record the steps run inside ``with pipe.trace() as t:`` (enter on every rank; it syncs clocks), then
        ``t.save("trace.json")`` on every rank: one Chrome trace of all ranks, written by rank 0. Steps in the
        block are recorded there only (not also by a ``trace=True`` pipeline's own recorder)."""
        return Trace(self)

    def save_trace(self, path: str | os.PathLike) -> Path | None:
        """With ``pipeline(..., trace=True)``: write the last recorded steps (up to 16) of all ranks as one
        Chrome trace on rank 0 (collective: call on every rank).

        Args:
            path: the JSON file rank 0 writes.

        Returns:
            ``path`` on rank 0, None on the other ranks.
        """
        if self._own_rec is None:
            raise RuntimeError("save_trace: this pipeline does not record steps; create it with "
                               "dapple.pipeline(..., trace=True), or use 'with pipe.trace() as t: ...; t.save(path)'")
        return write_trace(gather_trace(self, self._own_rec), path)

    def value_name(self, t: Transfer) -> str:
        """``value 'name'``: the model graph's name of the boundary value that transfer ``t`` carries."""
        return f"value {self._boundary[t.cut][t.value]!r}"

    def __repr__(self) -> str:
        s = self.plan.stages[self.stage]
        if len(self.stages) > 1:
            chunks = ", ".join(f"{i}: [{self.plan.stages[i].layers[0]}, {self.plan.stages[i].layers[1]})"
                               for i in self.stages)
            return (f"Pipeline(rank={self.ctx.rank}, stages={self.stages}/{self.plan.num_stages} ({chunks}), "
                    f"replica={self.replica}/{s.replicas}, device={self.ctx.device}, schedule={self.plan.schedule}, "
                    f"K={[self.plan.stages[i].warmup for i in self.stages]})")
        return (f"Pipeline(rank={self.ctx.rank}, stage={self.stage}/{self.plan.num_stages}, replica={self.replica}"
                f"/{s.replicas}, layers=[{s.layers[0]}, {s.layers[1]}), device={self.ctx.device}, "
                f"schedule={self.plan.schedule}, K={s.warmup})")


def _checked_options(loss_fn: Any, timeout: Any, trace: Any, deferred_batch_norm: Any) -> float:
    """TypeError/ValueError naming a bad option, before any process group is touched; the timeout in seconds."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable (output, *targets) -> scalar, got {loss_fn!r}")
    seconds = timeout_seconds("timeout", timeout)
    if not isinstance(trace, bool):
        raise TypeError(f"trace: expected True or False (record a timeline of each step), got {trace!r}; the "
                        f"choice between torch.fx and torch.export is tracer='auto'|'fx'|'export'")
    if not isinstance(deferred_batch_norm, bool):
        raise TypeError(f"deferred_batch_norm: expected True or False, got {deferred_batch_norm!r}")
    return seconds


def pipeline(model: nn.Module, plan: Plan, loss_fn: Callable[..., torch.Tensor], timeout: float = 60.0, *,
             concrete_args: dict[str, Any] | None = None, leaf_modules: LeafSpec | None = None,
             backend: str | None = None, tracer: str | None = None, example_inputs: Any = None,
             dynamic_shapes: Any = None, trace: bool = False, deferred_batch_norm: bool = False,
             layers: Sequence[str] | None = None, check_inputs: bool = True, mixed_precision: str | None = None,
             recompute: Recompute | Sequence[Recompute] | None = None, reduce_dtype: str | None = None,
             compile: bool | Mapping[str, Any] = False, init_fn: InitFn | None = None) -> Pipeline:
    """Run ``model`` as planned: this rank keeps only its stage and trains it with ``train_step``.

    Call on every rank (e.g. under ``torchrun --nproc_per_node=N``) with the same model, plan and loss; the
    default process group is initialised from torchrun's environment if needed (NCCL and ``cuda:LOCAL_RANK``
    when CUDA is available, gloo on the CPU otherwise).

    Args:
        model: the whole model, as built on every rank: on a real device (each rank keeps its stage's part), or
            on the meta device (``with torch.device("meta"):``, or with only the parameters there, as accelerate's
            ``init_empty_weights``): then each rank makes only its stage's tensors real, on its device, and
            initialises them with ``init_fn`` (load trained weights with :func:`dapple.load_weights`).
        plan: the plan (``dapple.plan`` or ``dapple.Plan.load``) for this world size. One whose
            ``shard_optimizer`` is set counted each stage's optimizer state sharded over its replicas: build the
            optimizer with :func:`dapple.shard_optimizer` then.
        loss_fn: ``loss_fn(output, *targets)``, the mean loss over the rows it is given; ``output`` is what the
            model returns (a tensor, tuple, dict or ``ModelOutput``), for those rows.
        timeout: seconds that bound every receive and collective: a dead or stuck peer makes the others raise
            :class:`PipelineError` naming rank, stage, peer and micro-batch.
        concrete_args, leaf_modules, tracer, example_inputs, dynamic_shapes: go to the tracer as for
            :func:`dapple.profile`. By default they are those the plan's profile was traced with
            (``plan.tracing``: the tracer it used, its concrete_args and leaf modules, and example inputs of its
            shapes and dtypes, by name where it took them so), so a plan made by :func:`dapple.plan` needs none of
            them; each one given takes precedence. A plan without ``tracing``: ``tracer="auto"`` (torch.fx, and
            torch.export from ``example_inputs`` where fx fails).
        backend: ``"nccl"``, ``"gloo"`` or None (NCCL where CUDA is available, else gloo); must match a default
            group the caller made.
        trace: record a timeline of every step (the last 16 are kept; ``pipe.save_trace(path)`` on every rank
            writes them as one Chrome trace); ``with pipe.trace() as t:`` records just the steps in a block.
        deferred_batch_norm: (torch.fx graphs) BatchNorm layers normalise each slice by its own statistics as
            always, but update their running statistics once per step with those of every row they saw in it
            (all micro-batches and replicas: the global batch), so every replica of a stage holds the same;
            otherwise each replica updates its own per slice, and they drift apart.
        layers: module paths that each become a layer (as for :func:`dapple.profile`); by default the plan's
            ``layer_names`` (a plan made from a profile names them), else the profiler's default rule.
        check_inputs: compare checksums of each step's inputs, targets and ids across the ranks that hold the
            same rows (one small AllReduce, a pass over what each rank holds; docs/data.md): a rank given its own
            shard of the global batch, or loading another order than the others, raises ValueError instead of
            training on a mix. Sizes and shapes are always compared.
        mixed_precision: "bf16" or "fp16": each stage runs its forward and the loss under ``torch.autocast`` in that
            dtype (parameters and gradients stay fp32), and activations and their gradients cross stages in it
            (half the bytes). "fp16" scales the loss dynamically, with one decision per step for every rank:
            ``pipe.scaler.step(opt); pipe.scaler.update()`` as with ``torch.amp.GradScaler``. "fp32": the model's
            own dtypes. None (default): as the plan says (``plan.mixed_precision``; a plan without it: the model's
            own dtypes). A value other than a plan's recorded one runs as asked, with a warning on rank 0 (the
            plan's memory and time estimates assumed its own).
        recompute: activation recomputation (``torch.utils.checkpoint``): True, a stage keeps only its inputs per
            micro-batch in flight and runs its forward again in the backward; "layers", it keeps every layer's
            inputs and recomputes one layer at a time (less memory at once in the backward); "selective", it keeps
            its inputs and the outputs of matmuls, convolutions and attention and recomputes the rest (little time);
            False: none. One of them for every stage, one per stage, or None: as the plan's stages say
            (``Stage.recompute``).
        reduce_dtype: the dtype gradients travel in for the stage AllReduce: "bf16" or "fp16" (half the bytes of
            fp32 on the links; each bucket is rounded to it, summed, and written back in the gradients' dtype),
            "fp32", or None (default): as the plan says (``plan.reduce_dtype``; a plan without it: the gradients'
            own dtype).
        compile: ``torch.compile`` each stage's forward (and so its backward): True (torch.compile's defaults),
            or a dict of torch.compile's keyword arguments (``{"mode": "max-autotune"}``, ``{"backend":
            "aot_eager"}``). A new input shape or a switch between :meth:`Pipeline.train` and
            :meth:`Pipeline.eval` recompiles, as torch.compile does. Not with a zb-h1 plan (ValueError): a
            compiled stage's backward is one autograd node, so its weight gradients cannot be deferred to W.
        init_fn: for a meta-device model: ``init_fn(module)``, called under ``torch.no_grad`` on each module of
            the model that directly holds a tensor of this rank's stage, once that tensor is real (uninitialised;
            buffers the model computed in ``__init__``, such as a rotary ``inv_freq``, must be computed again). It
            may fill the tensors in place or assign new ones. None: a transformers model's ``_init_weights``,
            otherwise each module's ``reset_parameters()`` where it has one. A tensor left uninitialised (checked
            by a sentinel it must overwrite) is a ValueError naming it. The replicas of a stage, and the stages
            sharing a tied parameter, then start from the first replica's values.

    Returns:
        This rank's :class:`Pipeline`.
    """
    return Pipeline(model, plan, loss_fn, timeout, concrete_args=concrete_args, leaf_modules=leaf_modules,
                    backend=backend, tracer=tracer, example_inputs=example_inputs, dynamic_shapes=dynamic_shapes,
                    trace=trace, deferred_batch_norm=deferred_batch_norm, layers=layers,
                    check_inputs=check_inputs, mixed_precision=mixed_precision, recompute=recompute,
                    reduce_dtype=reduce_dtype, compile=compile, init_fn=init_fn)
