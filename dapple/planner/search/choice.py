"""``dapple.plan``'s last word: the candidate plans it simulates, and the one the simulator finds fastest."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

from ...core.plan import Plan, Stage
from ...core.schedule import SPLIT_BACKWARD
from ..model.cost import CostModel, ServerLayout
from ..model.evaluate import PipelineCosts, pipeline_costs
from ..model.memory import split_backward_unfit
from ..schedule_choice import AUTO, CHOICES, TIE
from ..simulator.events import simulate
from ..simulator.floor import latency_floor
from . import forking
from .exact import JUDGE_EVERY, every_plan, plan_count
from .forking import forked_map

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.profile import Profile

VERIFY_WITHIN = 0.1  # plan(verify=): candidates modelled more than this fraction above the DP's plan are not simulated
INF = float("inf")
SIMULATE_LIMIT = 50_000  # devices x micro-batches above which plan() does not simulate its candidates


class Candidate(NamedTuple):
    """A plan the final choice may take: its modelled latency, micro-batch size, stages and their placement."""

    latency: float
    micro_batch_size: int
    spans: tuple  # ((a, c, server of each replica), ...)
    policies: tuple  # how each stage was placed


class Chosen(NamedTuple):
    """The plan chosen: micro-batch size, stages, their placement, the warmup policy and the schedule."""

    micro_batch_size: int
    spans: tuple
    policies: tuple
    warmup_policy: str
    schedule: str = CHOICES[0]


class Choice(NamedTuple):
    """What :func:`choose` did: the plan chosen, its simulated ms (None: the model's choice, nothing simulated),
    the trials (candidate x warmup policy) listed, those simulated, and the processes that ran them."""

    chosen: Chosen
    simulated_ms: float | None
    listed: int
    simulated: int
    workers: int


class Trial(NamedTuple):
    """A candidate with one warmup policy, as the Plan the simulator runs."""

    micro_batch_size: int
    spans: tuple
    policies: tuple
    warmup_policy: str
    plan: Plan


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
           mixed_precision: str | None = None, shard_optimizer: bool = False) -> Choice:
    """The DP's plan and warmup policy, or with ``verify`` the fastest in the event simulator.

    Args:
        profile, cluster, global_batch_size: the instance.
        candidates: the DP's plan first (it wins ties), then the others, by modelled latency.
        model, overlap, optimizer_factor: how the plans are modelled and run (model is unused here: the warmup
            policies are compared under the refined model, the one that tracks the simulator).
        schedule: the schedule each candidate is simulated under; "auto": each under dapple and under zb-h1
            (:data:`schedule_choice.CHOICES`), a split-backward one only where it fits in memory. The DP's plan
            under the first wins ties. Under a split backward ``within`` is not applied: the 1F1B model's ranking
            says little of how much of a plan's bubble W fills (the floors still skip the hopeless).
        warmup_policy: "A" or "B"; None: the better one under the refined model (A on ties).
        verify: simulate the first ``verify`` distinct candidates modelled within ``within`` of the DP's plan,
            each with the warmup policies modelled within ``within`` of its better one (0: trust the model).
        deadline: a time.perf_counter() value past which no candidate but the DP's own is listed; a search that
            ran past it simulates nothing (the model's choice).
        workers: processes simulating side by side (forking.forked_map); ``spare`` (more): used instead once the
            first simulation says the rest would take forking.FORK_WORTH.
        within: a fraction (None: VERIFY_WITHIN; inf: every candidate and policy, up to ``verify`` candidates).
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
            except ValueError:
                continue
        return out

    top = candidates[0]
    first = priced(top.micro_batch_size, top.spans)
    split = schedule in (AUTO, *SPLIT_BACKWARD)
    # the DP's plan under the schedule it models, until a trial under another simulates faster
    chosen = Chosen(top.micro_batch_size, top.spans, top.policies, warmup_policy or better_policy(first, overlap),
                    CHOICES[0] if split else schedule)
    too_big = cluster.num_devices * (global_batch_size // top.micro_batch_size) > SIMULATE_LIMIT
    late = deadline is not None and time.perf_counter() > deadline  # (no time left for simulations)
    if not verify or too_big or late:
        return Choice(chosen, None, 0, 0, 1)
    cms: dict[int, CostModel] = {}

    def fits(plan: Plan) -> bool:  # a split backward holds more activations (model.memory.split_backward_unfit)
        b = plan.micro_batch_size
        cm = cms.setdefault(b, CostModel(profile, cluster, b, optimizer_factor=optimizer_factor,
                                         mixed_precision=mixed_precision, shard_optimizer=shard_optimizer))
        return not split_backward_unfit(cm, plan.stages, plan.num_micro_batches, cluster.device_memory)

    trials = list_trials(candidates, first, priced, verify, deadline, overlap, cluster, global_batch_size,
                         CHOICES if schedule == AUTO else (schedule,), INF if split else within, mixed_precision, fits)
    return Simulations(profile, cluster, overlap, trials, workers).judge(chosen, spare)


def better_policy(costs: dict[str, PipelineCosts], overlap: bool) -> str:
    """The warmup policy the refined model prefers for a plan (formula 2 ignores K_i); A on ties (it holds fewer
    activations)."""
    lat = {pol: pc.latency("refined", overlap).total for pol, pc in costs.items()}
    return "B" if lat["B"] < lat["A"] * (1 - 1e-3) else "A"


def trial_plan(cluster: "Cluster", global_batch_size: int, b: int, spans: tuple, pc: PipelineCosts,
               pol: str, schedule: str, mixed_precision: str | None = None) -> Plan:
    """The Plan of a candidate with warmup policy ``pol`` (its K_i and recompute flags from ``pc``)."""
    devs = devices_of(spans, cluster)
    rc = pc.recompute or [False] * len(spans)
    return Plan(global_batch_size, b, [Stage((a, c), ds, k, r) for (a, c, _), ds, k, r in zip(spans, devs, pc.K, rc)],
                schedule=schedule, warmup_policy=pol, mixed_precision=mixed_precision)


def list_trials(candidates: Sequence[Candidate], first: dict, priced: Callable[[int, tuple], dict], verify: int,
                deadline: float | None, overlap: bool, cluster: "Cluster", global_batch_size: int,
                schedules: Sequence[str], within: float | None = None, mixed_precision: str | None = None,
                fits: Callable[[Plan], bool] | None = None) -> list[Trial]:
    """The trials to simulate, in order: the first ``verify`` distinct candidates within ``within`` of the
    first (none past ``deadline`` but the first) x their warmup policies within ``within`` of the better one x
    ``schedules`` (``first``: the first candidate's pipeline costs per policy; ``priced(b, spans)`` gives
    another's; ``fits(plan)``: whether a split-backward plan fits in memory, None: all do)."""
    seen, trials = set(), []
    within = VERIFY_WITHIN if within is None else within
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
            for sch in schedules:
                plan = trial_plan(cluster, global_batch_size, b, spans, pc, pol, sch, mixed_precision)
                if sch not in SPLIT_BACKWARD or fits is None or fits(plan):
                    trials.append(Trial(b, spans, policies, pol, plan))
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
        return simulate(trial.plan, self.profile, self.cluster, overlap=self.overlap).latency_ms

    def judge(self, chosen: Chosen, spare: int | None) -> Choice:
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
            below = self.pick(chosen)[1] * (1 - TIE)  # what a trial must simulate below to win
            rest = [k for k in rest if self.floor(k) < below]
            batch = rest[:1] if self.workers == 1 else rest  # one at a time in-process: the best falls as they go
            self.settle(batch)
            rest = rest[len(batch):]
        chosen, best_sim = self.pick(chosen)
        return Choice(chosen, best_sim, len(trials), len(self.took), self.used)

    def widen(self, spare: int) -> None:
        """Simulate the first trial here; fork the rest (``spare`` workers) if at that pace they take
        forking.FORK_WORTH (each trial's ops: as many per device as micro-batches, g / b)."""
        trials = self.trials
        t = time.perf_counter()
        self.took[0] = self.simulated(trials[0])
        b0 = trials[0].micro_batch_size
        if (time.perf_counter() - t) * sum(b0 / trial.micro_batch_size for trial in trials[1:]) > forking.FORK_WORTH:
            self.workers = spare

    def settle(self, ks: list[int]) -> None:
        """Simulate trials[k] for k in ``ks``, ``workers`` side by side."""
        trials, workers = self.trials, self.workers
        for k, t in zip(ks, forked_map(self.simulated, [trials[k] for k in ks], workers,
                                       f"simulating {len(trials)} candidate plans")):
            self.took[k] = t
        self.used = max(self.used, min(workers, len(ks)) if len(ks) > 1 else 1)

    def pick(self, chosen: Chosen) -> tuple[Chosen, float | None]:
        """The fastest simulated trial, in order (``chosen`` wins ties), and its ms."""
        best_sim = None
        for k, (b, spans, policies, pol, plan) in enumerate(self.trials):
            t = self.took.get(k)
            trial = Chosen(b, spans, policies, pol, plan.schedule)
            if t is not None and (best_sim is None or t < best_sim * (1 - TIE) or (
                    t <= best_sim * (1 + TIE) and trial[:2] + trial[3:] == chosen[:2] + chosen[3:])):
                best_sim = t
                chosen = trial
        return chosen, best_sim

    def floor(self, k: int) -> float:
        """No simulation of trials[k] is faster (floor.latency_floor, less 1e-9 of it: its sums run in another
        order than the simulator's)."""
        if k not in self.floors:
            b = self.trials[k].micro_batch_size
            if b not in self.cms:
                self.cms[b] = CostModel(self.profile, self.cluster, b,
                                        mixed_precision=self.trials[k].plan.mixed_precision)
            self.floors[k] = latency_floor(self.trials[k].plan, self.cms[b], self.overlap) * (1 - 1e-9)
        return self.floors[k]


def every_candidate(searches: Sequence) -> list[Candidate] | None:
    """Every plan of every micro-batch size searched (DPSearch-like: b, cm, M, config), by modelled latency, where
    they number at most exact.JUDGE_EVERY (then the simulator judges them all); None: more."""
    if not searches:
        return None
    cl = searches[0].cm.cluster
    if sum(plan_count(s.cm.num_layers, cl.servers, cl.devices_per_server, s.b, s.config.max_stages)
           for s in searches) > JUDGE_EVERY:
        return None
    every = [Candidate(lat, s.b, spans, ("enumerated",) * len(spans))
             for s in searches for lat, spans, _ in every_plan(s.cm, s.M, s.config)]
    return sorted(every, key=lambda c: (c.latency, -c.micro_batch_size))
