"""The Autotuner: every N steps, calibrate the documents from the traced steps, plan again, switch if the new plan's
calibrated estimate beats the measured step by a margin, and switch back if its measured steps are slower."""

from __future__ import annotations

import logging
import statistics
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist

from .calibration import calibrate, predictions
from .core.plan import Plan
from .planner import plan as make_plan
from .runtime.roll import called
from .runtime.tracing import Recorder, gather_trace, start_recorder

if TYPE_CHECKING:
    import torch

    from .core.cluster import Cluster
    from .core.profile import Profile
    from .runtime.engine import Pipeline

LOG = logging.getLogger("dapple.autotune")
Planner = Callable[["Profile", "Cluster", Plan], Plan]  # (calibrated profile, cluster, running plan) -> a candidate


@dataclass(frozen=True)
class Decision:
    """What the autotuner decided at the end of a window of steps, with the figures behind it.

    ``action``: "stay" (no better plan, or not better by the margin), "switch" (to a plan whose calibrated estimate
    beats the measured step by the margin), "trial" (to a plan asked for with :meth:`Autotuner.trial`), "keep"
    (the plan switched to measured no slower than the one before) or "rollback" (it measured slower: back to the
    one before)."""

    step: int  # the pipeline's step at the end of the window
    action: str
    measured_ms: float  # median step of the window (the plan that ran it)
    plan: str  # the plan that ran the window
    candidate: str | None = None  # the plan switched to, or considered
    estimate_ms: float | None = None  # the candidate's calibrated estimate (refined model)
    current_estimate_ms: float | None = None  # the running plan's calibrated estimate, beside its measured step
    before_ms: float | None = None  # keep / rollback: the measured step of the plan before the switch
    switch_seconds: float | None = None  # this rank's time to switch (Pipeline.replan)
    reason: str = ""
    calibration: dict = field(default_factory=dict)  # per-stage compute scales, runtime ms per op, link fits

    def __str__(self) -> str:
        figures = [f"measured {self.measured_ms:.1f} ms on {self.plan}"]
        if self.current_estimate_ms is not None:
            figures.append(f"its calibrated estimate {self.current_estimate_ms:.1f} ms")
        if self.candidate is not None:
            est = f" (calibrated estimate {self.estimate_ms:.1f} ms)" if self.estimate_ms is not None else ""
            figures.append(f"candidate {self.candidate}{est}")
        if self.before_ms is not None:
            figures.append(f"before the switch {self.before_ms:.1f} ms")
        if self.switch_seconds is not None:
            figures.append(f"switch took {self.switch_seconds:.2f} s")
        return f"step {self.step}: {self.action}: {self.reason}; " + ", ".join(figures)


@dataclass
class _Trial:
    """A switch under measurement: the plan before it and that plan's measured step."""

    previous: Plan
    previous_ms: float


class Autotuner:
    """Opt-in: re-plan a running pipeline from its own measured steps (call :meth:`step` on every rank after each
    training step)::

        tuner = dapple.runtime.Autotuner(pipe, profile, cluster, optimizer=opt, every=50)
        for x, y in batches:
            pipe.train_step(x, y); opt.step(); opt.zero_grad()
            tuner.step()

    It records the steps of each window of ``every`` steps (the tracer, on every rank). At a window's end, on rank
    0: the documents are calibrated from the window's trace (:func:`dapple.calibrate`, from ``profile`` and
    ``cluster`` each time), a plan is made from them (``planner``; default :func:`dapple.plan` for the same global
    batch and schedule), and if that plan differs from the running one and its calibrated estimate is below the
    window's measured median step by ``margin``, every rank switches to it (:meth:`Pipeline.replan`, which also
    moves ``optimizer``). The next window measures the new plan: if its median step is slower than the old
    plan's, every rank switches back and that plan is not tried again (the rule of FastT: strategies are rolled
    back when the measured iteration gets slower). Every decision is logged on rank 0 (logger
    ``dapple.autotune``, INFO) with its figures and kept in :attr:`history` on every rank.

    A rank that passes each step's global batch needs nothing else; one that loads only its own rows must follow
    ``pipe.rows()`` again after a switch (:meth:`step` returns the decision; ``decision.action`` in ("switch",
    "trial", "rollback") means the plan changed).

    Args:
        pipe: the pipeline (its plan is the first one).
        profile, cluster: the documents the running plan was made from.
        optimizer: an optimizer over ``pipe.parameters()`` (on every rank, or none), moved with each switch.
        every: steps per window (the first ``skip`` after a switch are not measured).
        margin: a candidate must be estimated at least this share faster than the measured step.
        skip: steps left out of a window's measurement after a switch (the first step under a new plan pays
            one-off costs).
        planner: ``(profile, cluster, running plan) -> plan``, called on rank 0 with the calibrated documents.
        plan_options: keyword arguments for the default planner (:func:`dapple.plan`).
    """

    def __init__(self, pipe: "Pipeline", profile: "Profile", cluster: "Cluster", *,
                 optimizer: "torch.optim.Optimizer | None" = None, every: int = 50, margin: float = 0.05,
                 skip: int = 1, planner: Planner | None = None, plan_options: dict[str, Any] | None = None):
        if not isinstance(every, int) or isinstance(every, bool) or every < skip + 2:
            raise ValueError(f"Autotuner: every must be an integer >= skip + 2 = {skip + 2} (a window needs two "
                             f"measured steps), got {every!r}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"Autotuner: margin must be a share in [0, 1), got {margin!r}")
        self.pipe, self.profile, self.cluster, self.optimizer = pipe, profile, cluster, optimizer
        self.every, self.margin, self.skip = every, margin, skip
        self.planner = planner or _default_planner(pipe.plan, dict(plan_options or {}))
        self.history: list[Decision] = []
        self.rejected: set[str] = set()  # plans rolled back, by their key
        self._trial: _Trial | None = None
        self._asked: Plan | None = None
        self._switched = False  # the window running now started under a new plan
        self._group = called(pipe.timeout, self._who(), "Autotuner: creating the gloo group of every rank",
                             range(pipe.ctx.world_size), dist.new_group, list(range(pipe.ctx.world_size)),
                             timeout=timedelta(seconds=pipe.timeout), backend="gloo")
        self._steps = 0
        self._recorder: Recorder | None = self._record()  # None once a plan switch failed

    # ---- public ------------------------------------------------------------------------------------
    def step(self) -> Decision | None:
        """After each training step, on every rank: at the end of a window, decide (collective) and return the
        decision; None otherwise."""
        self._steps += 1
        if self._steps < self.every:
            return None
        if self._recorder is None:
            raise RuntimeError(f"Autotuner.step at step {self.pipe.global_step}: a plan switch failed before; the "
                               f"autotuner records nothing since")
        gathered = gather_trace(self.pipe, self._recorder)  # collective: every rank's events, on rank 0
        decision, target = None, None
        if gathered is not None:
            try:
                decision, target = self._decide(gathered)
            except Exception as e:  # rank 0's own failure (no step recorded, a plan the model refuses): no change
                decision = Decision(step=self.pipe.global_step, action="stay", measured_ms=float("nan"),
                                    plan=_key(self.pipe.plan), reason=f"failed: {type(e).__name__}: {e}")
        decision, target = self._share((decision, None if target is None else target.to_dict()))
        if target is not None:
            try:
                switch = self.pipe.replan(target, self.optimizer)
            finally:
                self._recorder = None
            decision = _with(decision, switch_seconds=round(switch.seconds, 4))
        self._switched = target is not None
        self.history.append(decision)
        if self.pipe.ctx.rank == 0:
            LOG.info("%s", decision)
        self._steps = 0
        self._recorder = self._record()
        return decision

    def trial(self, plan: Plan) -> None:
        """Switch to ``plan`` at the end of the current window whatever its estimate, then keep it or roll back by
        its measured steps as for any switch (call on every rank; rank 0's plan is the one used)."""
        if not isinstance(plan, Plan):
            raise TypeError(f"Autotuner.trial: expected a dapple.Plan, got {type(plan).__name__}")
        self._asked = plan

    # ---- rank 0 -----------------------------------------------------------------------------------
    def _decide(self, gathered: tuple) -> tuple[Decision, Plan | None]:
        """The decision on the window's trace, and the plan to switch to (None: none)."""
        events, meta = gathered
        skip = self.skip if self._switched else 0
        steps = sorted({e.args.get("step") for e in events if e.args.get("step") is not None})[skip:]
        kept = [e for e in events if e.args.get("step") in set(steps)]
        running = self.pipe.plan
        measured = _median_step(kept)
        base: dict[str, Any] = dict(step=self.pipe.global_step, measured_ms=round(measured, 3), plan=_key(running))
        if self._trial is not None:  # the window measured a plan switched to: keep it, or go back
            trial, self._trial = self._trial, None
            if measured > trial.previous_ms:
                self.rejected.add(_key(running))
                return Decision(action="rollback", candidate=_key(trial.previous),
                                before_ms=round(trial.previous_ms, 3),
                                reason="the new plan measured slower than the one before", **base), trial.previous
            return Decision(action="keep", before_ms=round(trial.previous_ms, 3),
                            reason="the new plan measured no slower than the one before", **base), None
        if self._asked is not None:
            asked, self._asked = self._asked, None
            self._trial = _Trial(running, measured)
            return Decision(action="trial", candidate=_key(asked), reason="asked for", **base), asked
        return self._consider((kept, meta), running, measured, base)

    def _consider(self, trace: tuple, running: Plan, measured: float, base: dict) -> tuple[Decision, Plan | None]:
        prof, clus = calibrate(self.profile, self.cluster, trace)
        cal = prof.meta["calibration"]
        summary = {"stages": cal["stages"][0], "overhead_ms_per_op": cal["overhead_ms_per_op"],
                   "links": clus.meta["calibration"]["links"], "allreduce": clus.meta["calibration"]["allreduce"]}
        current = predictions(running, prof, clus)["estimate"]
        base = dict(base, current_estimate_ms=_round(current), calibration=summary)
        try:
            candidate = self.planner(prof, clus, running)
        except ValueError as e:
            return Decision(action="stay", reason=f"no plan: {e}", **base), None
        key = _key(candidate)
        estimate = predictions(candidate, prof, clus)["estimate"]
        base = dict(base, candidate=key, estimate_ms=_round(estimate))
        if key == _key(running):
            return Decision(action="stay", reason="the running plan is still the best", **base), None
        if key in self.rejected:
            return Decision(action="stay", reason="the best plan was rolled back before", **base), None
        if candidate.num_devices != self.pipe.ctx.world_size:
            return Decision(action="stay", reason=f"the best plan uses {candidate.num_devices} devices", **base), None
        if estimate is None or estimate >= measured * (1 - self.margin):
            return Decision(action="stay", reason=f"not {self.margin:.0%} faster than measured", **base), None
        self._trial = _Trial(running, measured)
        return Decision(action="switch", reason=f"estimated {1 - estimate / measured:.1%} faster than measured",
                        **base), candidate

    # ---- every rank --------------------------------------------------------------------------------
    def _share(self, value: tuple) -> tuple:
        """Rank 0's ``value`` on every rank (bounded by the pipeline's timeout)."""
        box: list[Any] = [value if self.pipe.ctx.rank == 0 else None]
        called(self.pipe.timeout, self._who(), "Autotuner: the decision from rank 0", range(self.pipe.ctx.world_size),
               dist.broadcast_object_list, box, src=0, group=self._group)
        decision, target = box[0]
        return decision, None if target is None else Plan.from_dict(target)

    def _record(self) -> Recorder:
        """A recorder of the next window's steps, installed in the pipeline (collective: syncs clocks)."""
        rec = start_recorder(self.pipe, self.every)
        self.pipe.recorder = rec
        return rec

    def _who(self) -> str:
        return f"rank {self.pipe.ctx.rank} (stage {self.pipe.stage})"


def _default_planner(first: Plan, options: dict[str, Any]) -> Planner:
    """dapple.plan for the running plan's global batch and schedule, one search worker (it runs inside a job)."""
    options = {"schedule": first.schedule, "workers": 1, **options}

    def planner(profile: "Profile", cluster: "Cluster", running: Plan) -> Plan:
        return make_plan(profile, cluster, running.global_batch_size, **options)
    return planner


def _median_step(events: list) -> float:
    """Median over steps of the earliest start to the latest end of the ranks' train_step spans, in ms."""
    spans: dict[Any, list] = {}
    for e in events:
        if e.args.get("lane") == "step":
            spans.setdefault(e.args.get("step"), []).append(e)
    if not spans:
        raise ValueError("Autotuner: the window recorded no step")
    return statistics.median((max(e.end for e in es) - min(e.start for e in es)) * 1e3 for es in spans.values())


def _key(plan: Plan) -> str:
    """What makes two plans the same run: stages (layers, devices, K_i), micro-batch, schedule."""
    stages = " ".join(f"{s.layers[0]}-{s.layers[1]}@{','.join(map(str, s.devices))}K{s.warmup}" for s in plan.stages)
    return f"{stages} b{plan.micro_batch_size} {plan.schedule}"


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def _with(d: Decision, **changes: Any) -> Decision:
    return Decision(**{**asdict(d), **changes})
