"""``dapple.plan``'s last word: the simulator judges the candidate plans (and schedules) and takes the fastest."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

from ..core.plan import Plan, Stage
from ..core.schedule import SPLIT_BACKWARD
from . import tuning
from .model.cost import CostModel, ServerLayout
from .model.evaluate import PipelineCosts, pipeline_costs
from .model.memory import NoFitError, split_backward_unfit
from .search.exact import plan_count, priced_plans
from .simulator.events import simulate
from .simulator.floor import latency_floor
from .workers import forked_map

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..core.profile import Profile

INF = float("inf")
AUTO = "auto"
CHOICES = ("dapple", "zb-h1")  # in order of preference on a tie: dapple holds fewer activations on later stages


class Candidate(NamedTuple):
    """A plan the final choice may take: its modelled latency, micro-batch size, stages and their placement."""

    latency: float
    micro_batch_size: int
    spans: tuple  # ((a, c, server of each replica), ...)
    policies: tuple  # how each stage was placed


class Trial(NamedTuple):
    """A candidate under one warmup policy and schedule; ``plan``: the Plan the simulator runs (None: not built)."""

    micro_batch_size: int
    spans: tuple
    policies: tuple
    warmup_policy: str
    schedule: str = CHOICES[0]
    plan: Plan | None = None

    def same(self, other: "Trial") -> bool:
        """The same plan under the same policy and schedule (however its stages were placed)."""
        return (self.micro_batch_size, self.spans, self.warmup_policy, self.schedule) == (
            other.micro_batch_size, other.spans, other.warmup_policy, other.schedule)

    def built(self) -> Plan:
        """``plan``, of a trial listed for simulation (those are built)."""
        if self.plan is None:
            raise ValueError(f"trial (micro-batch {self.micro_batch_size}, spans {self.spans}): no plan built")
        return self.plan


class Verdict(NamedTuple):
    """What :func:`choose` did: the trial chosen, its simulated ms (None: the model's choice, nothing simulated),
    the trials listed, those simulated, and the processes that ran them."""

    chosen: Trial
    simulated_ms: float | None
    listed: int
    simulated: int
    workers: int


def faster(t: float, best: float | None) -> bool:
    """Whether a later trial's ``t`` displaces the ``best`` so far: SearchTuning.tie faster (earlier ones win ties)."""
    return best is None or t < best * (1 - tuning.TUNING.tie)


def devices_of(spans: Sequence[tuple[int, int, ServerLayout]], cluster: "Cluster") -> list[list[int]]:
    """Concrete device ids for stages given as server layouts: each replica takes the lowest free device
    of its server."""
    nxt = [s * cluster.devices_per_server for s in range(cluster.servers)]
    out = []
    for _, _, lay in spans:
        ds = []
        for s in lay:
            ds.append(nxt[s])
            nxt[s] += 1
        out.append(ds)
    return out


def choose(profile: "Profile", cluster: "Cluster", global_batch_size: int, candidates: Sequence[Candidate], *,
           model: str, overlap: bool, schedule: str, warmup_policy: str | None, optimizer_factor: float,
           verify: int, deadline: float | None = None, workers: int = 1, spare: int | None = None,
           within: float | None = None, recompute: bool | str = False,
           mixed_precision: str | None = None, shard_optimizer: bool = False) -> Verdict:
    """The DP's plan and warmup policy, or with ``verify`` the fastest in the event simulator.

    Args:
        profile, cluster, global_batch_size: the instance.
        candidates: the DP's plan first (it wins ties), then the others, by modelled latency.
        model, overlap, optimizer_factor: how the plans are modelled and run (model is unused here: the warmup
            policies are compared under the refined model, the one that tracks the simulator).
        schedule: the schedule each candidate is simulated under; "auto": each under dapple and under zb-h1
            (:data:`CHOICES`), a split-backward one only where it fits in memory. The DP's plan under the first wins
            ties. Under a split backward ``within`` is not applied: the 1F1B model's ranking says little of how much
            of a plan's bubble W fills (the floors still skip the hopeless).
        warmup_policy: "A" or "B"; None: the better one under the refined model (A on ties).
        verify: simulate the first ``verify`` distinct candidates modelled within ``within`` of the DP's plan,
            each with the warmup policies modelled within ``within`` of its better one (0: trust the model).
        deadline: a time.perf_counter() value past which no candidate but the DP's own is listed; a search that
            ran past it simulates nothing (the model's choice).
        workers: processes simulating side by side (workers.forked_map); ``spare`` (more): used instead once the
            first simulation says the rest would take SearchTuning.fork_worth.
        within: a fraction (None: SearchTuning.verify_within; inf: every candidate and policy, up to ``verify``).
        recompute, mixed_precision, shard_optimizer: as the search priced the stages (SearchConfig); the trial plans
            record the first two.

    A candidate whose floor (floor.latency_floor) is above the best simulated before it is not simulated: it
    could not win.
    """
    pols = (warmup_policy,) if warmup_policy else ("A", "B")

    def priced(b: int, spans: tuple) -> dict[str, PipelineCosts]:  # per warmup policy (none where it does not fit)
        cm, out = CostModel(profile, cluster, b, optimizer_factor=optimizer_factor, recompute=recompute,
                            mixed_precision=mixed_precision, shard_optimizer=shard_optimizer), {}
        for pol in pols:
            try:
                out[pol] = pipeline_costs(cm, spans, global_batch_size // b, pol)[0]
            except NoFitError:
                continue
        return out

    top = candidates[0]
    first = priced(top.micro_batch_size, top.spans)
    split = schedule in (AUTO, *SPLIT_BACKWARD)
    # the DP's plan under the schedule it models, until a trial under another simulates faster
    chosen = Trial(top.micro_batch_size, top.spans, top.policies, warmup_policy or better_policy(first, overlap),
                   CHOICES[0] if split else schedule)
    too_big = cluster.num_devices * (global_batch_size // top.micro_batch_size) > tuning.TUNING.simulate_limit
    late = deadline is not None and time.perf_counter() > deadline  # (no time left for simulations)
    if not verify or too_big or late:
        return Verdict(chosen, None, 0, 0, 1)
    cms: dict[int, CostModel] = {}

    def fits(plan: Plan) -> bool:  # a split backward holds more activations (model.memory.split_backward_unfit)
        b = plan.micro_batch_size
        cm = cms.setdefault(b, CostModel(profile, cluster, b, optimizer_factor=optimizer_factor,
                                         mixed_precision=mixed_precision, shard_optimizer=shard_optimizer))
        return not split_backward_unfit(cm, plan.stages, plan.num_micro_batches, cluster.device_memory)

    listing = Listing(cluster, global_batch_size, CHOICES if schedule == AUTO else (schedule,),
                      INF if split else within, mixed_precision)
    trials = listing.trials(candidates, first, priced, verify, deadline, overlap, fits)
    return Simulations(profile, cluster, overlap, trials, workers).judge(chosen, spare)


def better_policy(costs: dict[str, PipelineCosts], overlap: bool) -> str:
    """The warmup policy the refined model prefers for a plan (formula 2 ignores K_i); A on ties (it holds fewer
    activations)."""
    lat = {pol: pc.latency("refined", overlap).total for pol, pc in costs.items()}
    return "B" if lat["B"] < lat["A"] * (1 - 1e-3) else "A"


class Listing:
    """Which trials the final choice simulates: the cluster and batch they run on, the ``schedules`` each candidate
    is tried under, how far (``within``, a fraction; None: SearchTuning.verify_within) a candidate or warmup policy
    may be modelled above the best one, and the plans' mixed precision."""

    def __init__(self, cluster: "Cluster", global_batch_size: int, schedules: Sequence[str],
                 within: float | None = None, mixed_precision: str | None = None):
        self.cluster, self.global_batch_size, self.schedules = cluster, global_batch_size, schedules
        self.within = tuning.TUNING.verify_within if within is None else within
        self.mixed_precision = mixed_precision

    def plan(self, b: int, spans: tuple, pc: PipelineCosts, pol: str, schedule: str) -> Plan:
        """The Plan of a candidate with warmup policy ``pol`` (its K_i and recompute flags from ``pc``)."""
        devs = devices_of(spans, self.cluster)
        rc = pc.recompute or [False] * len(spans)
        return Plan(self.global_batch_size, b,
                    [Stage((a, c), ds, k, r) for (a, c, _), ds, k, r in zip(spans, devs, pc.K, rc)],
                    schedule=schedule, warmup_policy=pol, mixed_precision=self.mixed_precision)

    def trials(self, candidates: Sequence[Candidate], first: dict, priced: Callable[[int, tuple], dict],
               verify: int, deadline: float | None, overlap: bool,
               fits: Callable[[Plan], bool] | None = None) -> list[Trial]:
        """The trials to simulate, in order: the first ``verify`` distinct candidates within ``within`` of the
        first (none past ``deadline`` but the first) x their warmup policies within ``within`` of the better one x
        ``schedules`` (``first``: the first candidate's pipeline costs per policy; ``priced(b, spans)`` gives
        another's; ``fits(plan)``: whether a split-backward plan fits in memory, None: all do)."""
        seen: set[tuple[int, tuple]] = set()
        trials: list[Trial] = []
        within = self.within
        top = candidates[0].latency
        for lat, b, spans, policies in candidates:
            if lat > top * (1 + within):
                break  # the rest are sorted by modelled latency: all further off
            if (b, spans) in seen or len(seen) >= verify or (seen and deadline and time.perf_counter() > deadline):
                continue
            costs = first if not seen else priced(b, spans)
            seen.add((b, spans))
            # a policy the refined model puts more than ``within`` above the other on this plan is not simulated
            lats = {pol: pc.latency("refined", overlap).total for pol, pc in costs.items()}
            for pol, pc in costs.items():
                if lats[pol] > min(lats.values()) * (1 + within):
                    continue
                for sch in self.schedules:
                    plan = self.plan(b, spans, pc, pol, sch)
                    if sch not in SPLIT_BACKWARD or fits is None or fits(plan):
                        trials.append(Trial(b, spans, policies, pol, sch, plan))
        return trials


class Simulations:
    """The trials' simulations: run in order, side by side by ``workers`` processes, and skipped where a trial's
    floor shows it cannot beat the best simulated so far."""

    def __init__(self, profile: "Profile", cluster: "Cluster", overlap: bool, trials: list[Trial], workers: int):
        self.profile, self.cluster, self.overlap = profile, cluster, overlap
        self.trials, self.workers = trials, workers
        self.took: dict[int, float] = {}  # trial index -> simulated ms (one left out was skipped)
        self.used = 1  # the most processes that ran simulations side by side
        self.cms: dict[int, CostModel] = {}  # micro-batch size -> CostModel, as simulate() makes it
        self.floors: dict[int, float] = {}  # trial index -> its floor

    def simulated(self, trial: Trial) -> float:
        return simulate(trial.built(), self.profile, self.cluster, overlap=self.overlap).latency_ms

    def judge(self, chosen: Trial, spare: int | None) -> Verdict:
        """The fastest simulated trial (the DP's plan, ``chosen``, wins ties): first the DP's own trials and as many
        more as run side by side, then the others whose floor is below the best so far, which only falls from
        there (so a skipped one could not have won)."""
        trials = self.trials
        if spare is not None and self.workers < spare and len(trials) > 2:
            self.widen(spare)
        own = sum((t.micro_batch_size, t.spans) == chosen[:2] for t in trials)  # (listed first)
        self.settle([k for k in range(min(len(trials), max(own, self.workers))) if k not in self.took])
        rest = [k for k in range(len(trials)) if k not in self.took]
        while rest:
            best = self.pick(chosen)[1]
            if best is None:
                raise RuntimeError(f"judge: none of {len(trials)} trials was simulated")
            below = best * (1 - tuning.TUNING.tie)  # what a trial must simulate below to win
            rest = [k for k in rest if self.floor(k) < below]
            batch = rest[:1] if self.workers == 1 else rest  # one at a time in-process: the best falls as they go
            self.settle(batch)
            rest = rest[len(batch):]
        chosen, best_sim = self.pick(chosen)
        return Verdict(chosen, best_sim, len(trials), len(self.took), self.used)

    def widen(self, spare: int) -> None:
        """Simulate the first trial here; fork the rest (``spare`` workers) if at that pace they take
        SearchTuning.fork_worth (each trial's ops: as many per device as micro-batches, g / b)."""
        trials = self.trials
        t = time.perf_counter()
        self.took[0] = self.simulated(trials[0])
        b0 = trials[0].micro_batch_size
        pace = (time.perf_counter() - t) * sum(b0 / trial.micro_batch_size for trial in trials[1:])
        if pace > tuning.TUNING.fork_worth:
            self.workers = spare

    def settle(self, ks: list[int]) -> None:
        """Simulate trials[k] for k in ``ks``, ``workers`` side by side."""
        trials, workers = self.trials, self.workers
        for k, t in zip(ks, forked_map(self.simulated, [trials[k] for k in ks], workers,
                                       f"simulating {len(trials)} candidate plans")):
            self.took[k] = t
        self.used = max(self.used, min(workers, len(ks)) if len(ks) > 1 else 1)

    def pick(self, chosen: Trial) -> tuple[Trial, float | None]:
        """The fastest simulated trial, in order (``chosen`` wins ties), and its ms."""
        best_sim = None
        for k, trial in enumerate(self.trials):
            t = self.took.get(k)
            if t is not None and (faster(t, best_sim) or (best_sim is not None  # (faster: when it is None)
                                                          and t <= best_sim * (1 + tuning.TUNING.tie)
                                                          and trial.same(chosen))):
                best_sim = t
                chosen = trial._replace(plan=None)
        return chosen, best_sim

    def floor(self, k: int) -> float:
        """No simulation of trials[k] is faster (floor.latency_floor, less 1e-9 of it: its sums run in another
        order than the simulator's)."""
        if k not in self.floors:
            b = self.trials[k].micro_batch_size
            if b not in self.cms:
                self.cms[b] = CostModel(self.profile, self.cluster, b,
                                        mixed_precision=self.trials[k].built().mixed_precision)
            self.floors[k] = latency_floor(self.trials[k].built(), self.cms[b], self.overlap) * (1 - 1e-9)
        return self.floors[k]


def settle_schedule(schedule: str, plan: Plan, profile: "Profile", cluster: "Cluster", *, overlap: bool,
                    optimizer_factor: float) -> tuple[str, dict | None]:
    """plan()'s last word on the schedule of the plan it found (its K_i set): "auto" picks
    (:func:`choose_schedule`, with its record); a split-backward schedule asked for by name must fit in memory
    (NoFitError naming the stage); any other stays as it is (record None)."""
    if schedule == AUTO:
        return choose_schedule(profile, cluster, plan.stages, plan.global_batch_size, plan.micro_batch_size,
                               overlap=overlap, optimizer_factor=optimizer_factor,
                               mixed_precision=plan.mixed_precision, shard_optimizer=plan.shard_optimizer)
    if schedule in SPLIT_BACKWARD:
        cm = CostModel(profile, cluster, plan.micro_batch_size, optimizer_factor=optimizer_factor,
                       mixed_precision=plan.mixed_precision, shard_optimizer=plan.shard_optimizer)
        why = split_backward_unfit(cm, plan.stages, plan.num_micro_batches, cluster.device_memory)
        if why:
            raise NoFitError(f"schedule={schedule!r}: the plan found does not fit: {why}; schedule='auto' falls "
                             f"back to 'dapple' where it does not")
    return schedule, None


def choose_schedule(profile: "Profile", cluster: "Cluster", stages: Sequence[Stage], global_batch_size: int,
                    micro_batch_size: int, *, overlap: bool, optimizer_factor: float,
                    mixed_precision: str | None = None, shard_optimizer: bool = False) -> tuple[str, dict]:
    """The faster of :data:`CHOICES` for ``stages`` (their K_i set), simulated, and what was found.

    zb-h1 keeps each micro-batch's activations until its W and lets every stage hold K_0 of them
    (``core.schedule.stage_holds``; a recomputing stage runs its whole backward in B and holds its K_i): it is a
    candidate only where that fits in device memory on every stage.

    Args:
        profile, cluster: the model's layers and the devices.
        stages: the plan's stages, warmup K_i included.
        global_batch_size, micro_batch_size: the plan's batch sizes.
        overlap: AllReduce overlapped with the last backward, as planned.
        optimizer_factor: bytes held per parameter byte.
        mixed_precision: the plan's ("bf16"/"fp16"; None: full precision).
        shard_optimizer: the plan's: each stage's optimizer state sharded over its replicas (memory).

    Returns:
        (schedule, record): ``record["simulated_ms"]`` per candidate, ``record["refused"]`` a reason per one left
        out, ``record["chosen"]``.
    """
    cm = CostModel(profile, cluster, micro_batch_size, optimizer_factor=optimizer_factor,
                   mixed_precision=mixed_precision, shard_optimizer=shard_optimizer)
    simulated: dict[str, float] = {}
    refused: dict[str, str] = {}
    M = global_batch_size // micro_batch_size
    for name in CHOICES:
        if name in SPLIT_BACKWARD and (why := split_backward_unfit(cm, stages, M, cluster.device_memory)):
            refused[name] = why
            continue
        plan = Plan(global_batch_size, micro_batch_size, list(stages), schedule=name, mixed_precision=mixed_precision)
        simulated[name] = round(simulate(plan, profile, cluster, overlap=overlap).latency_ms, 6)
    chosen = CHOICES[0]  # another must simulate faster, as when the simulator judges candidates
    for name in CHOICES[1:]:
        if name in simulated and faster(simulated[name], simulated[chosen]):
            chosen = name
    record: dict = {"simulated_ms": simulated, "chosen": chosen}
    if refused:
        record["refused"] = refused
    return chosen, record


def every_candidate(searches: Sequence) -> list[Candidate] | None:
    """Every plan of every micro-batch size searched (DPSearch-like: b, cm, M, config), by modelled latency, where
    they number at most SearchTuning.judge_every (then the simulator judges them all); None: more."""
    if not searches:
        return None
    cl = searches[0].cm.cluster
    if sum(plan_count(s.cm.num_layers, cl.servers, cl.devices_per_server, s.b, s.config.max_stages)
           for s in searches) > tuning.TUNING.judge_every:
        return None
    every = [Candidate(lat, s.b, spans, ("enumerated",) * len(spans))
             for s in searches for lat, spans, _ in priced_plans(s.cm, s.M, s.config)]
    return sorted(every, key=lambda c: (c.latency, -c.micro_batch_size))
