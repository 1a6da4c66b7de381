"""``dapple.plan``: the DP of formulas 4-5 over micro-batch sizes, warmup policy choice, and the Plan it makes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..core.checks import flag, is_int, is_real, non_negative_int, number, positive_int
from ..core.plan import Plan, Recompute, Stage
from ..core.schedule import CHUNKED_SCHEDULES, SCHEDULES, SPLIT_BACKWARD, WARMUP_POLICIES
from . import tuning
from .checks import profile_and_cluster
from .chunked import chunked_schedules, settle_chunks
from .judge import (
    AUTO,
    Candidate,
    Verdict,
    choose,
    devices_of,
    every_candidate,
    settle_schedule,
)
from .model.cost import CostModel
from .model.evaluate import MODELS, evaluate, pipeline_costs
from .model.memory import NoFitError, activation_scale, recompute_mode
from .profiled import profiled
from .search.dp import (
    INF,
    DPSearch,
    SearchConfig,
    SearchResult,
    can_occupy,
    most_stages,
)
from .search.memo import gc_paused
from .search.records import Progress
from .simulator.events import simulate
from .workers import forked_map, resolve_workers

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..core.profile import Profile

SEARCHES = ("auto", "full", "compact")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _repriced(profile: "Profile", cluster: "Cluster", p: Plan, **kwargs: Any) -> object:
    """A plan found on a joined profile (profiled.py), estimated on the profile's own layers."""
    return evaluate(profile, cluster, p, optimizer_factor=kwargs.get("optimizer_factor", 4.0))


@profiled(_repriced)  # never cuts where the profile forbids it; carries its tracing
@gc_paused()  # the seeds and the simulator's checks allocate as much as the search
def plan(profile: "Profile", cluster: "Cluster", global_batch_size: int, micro_batch_size: int | None = None, *,
         model: str = "refined", overlap: bool = True, schedule: str = "dapple", warmup_policy: str | None = None,
         optimizer_factor: float = 4.0, beam: int = 1, micro_batch_sizes: Sequence[int] | None = None,
         max_stages: int | None = None, search: str = "auto", time_limit: float | str | None = "auto",
         gap: float = 0.0, verify: int = 6, workers: int | str = "auto", recompute: Recompute = False,
         mixed_precision: str | None = None, shard_optimizer: bool = False) -> Plan:
    """The plan minimising the modelled latency of one iteration of ``global_batch_size`` samples on ``cluster``,
    among the plans that use every device of it (a plan's device ids are the ranks 0..n-1 of the job that runs
    it). Where fewer devices may do better (a tiny global batch, very slow links), plan for a smaller Cluster
    too and compare the estimates. Stage splits, replication and Fresh/Append/Scatter placement are searched by
    the DP of formulas 4-5 (:func:`dapple.planner.search.dp.dp_search`) for each micro-batch size.

    Args:
        profile: the model's layers (dapple.profile or Profile.load).
        cluster: the devices; the plan uses all of them.
        global_batch_size: samples per iteration.
        micro_batch_size: plan for this micro-batch size only (a divisor of the global batch).
        model: "refined" (the latency model that tracks the event simulator, planner.model.refined) or "paper"
            (formula 2 as printed).
        overlap: gradient AllReduce overlapped with the last backward, bucket by bucket, as dapple's runtime runs
            every plan (the default). ``model="paper", overlap=False`` is the paper's planner, for its tables.
        schedule: core.schedule.SCHEDULES, or "auto": dapple or zb-h1, whichever is faster, or (refined model) a
            plan of two chunks per device group under interleaved-1f1b or zb-v where one simulates faster
            (:func:`_settled`, planner/chunked.py); "interleaved-1f1b" or "zb-v": the best plan of two chunks per
            device group in that order.
        warmup_policy: "A" or "B"; None: the better one under the refined model (A on ties: it holds fewer
            activations). K_i is recorded per stage.
        optimizer_factor: bytes held per parameter byte (weights, gradients, optimizer state).
        beam: prefixes kept per DP state (the paper keeps 1).
        micro_batch_sizes: the sizes to search (divisors of the global batch); default: every divisor.
        max_stages: the most stages (pipeline depth) a plan may have.
        search: "full" composes Fresh/Append/Scatter freely; "compact" keeps only placements after which all
            partly used servers are alike (large clusters in seconds; docs/planner.md); "auto": full up to
            SearchTuning.compact_above servers, compact above.
        time_limit: seconds; when they run out the best plan found so far is returned and
            ``meta["search_complete"]`` is False (``meta["latency_lower_bound_ms"]`` says how far from the
            optimum it can be). "auto": no limit for the full search, SearchTuning.compact_time_limit for the
            compact one; None or math.inf: no limit.
        gap: a fraction (e.g. 0.01): the search drops whatever cannot beat the best plan found by more than this,
            so the plan is within (1 + gap) of the one the search would find without it, sooner.
        verify: the final choice among the DP's plan, the best plan of each other micro-batch size (full search)
            and the sizes' seed plans, the first ``verify`` of them modelled within SearchTuning.verify_within of
            the DP's plan, each with the warmup policies modelled within that of the better one, is made by the
            event simulator (judge.py; 0: trust the model; skipped above SearchTuning.simulate_limit devices x
            micro-batches); ``meta`` records it. Where all sizes have at most SearchTuning.judge_every plans
            together, the simulator judges every plan and policy instead.
        workers: processes searching micro-batch sizes side by side (forked: Linux only; the plan is the same for
            any number); "auto" as docs/planner.md says. A worker that dies or is stuck
            (SearchTuning.worker_stuck) makes plan() raise RuntimeError.
        recompute: activation recomputation: False; in every stage, True (its whole forward again in the
            backward), "layers" (layer by layer: more kept per micro-batch, less at once) or "selective" (the
            outputs of matmuls, convolutions and attention kept: a profile made with selective=True); or "auto":
            the whole stage, only where memory binds and it is faster (docs/planner.md).
        mixed_precision: "bf16"/"fp16": activations take half the bytes (docs/planner.md); None: full precision.
        shard_optimizer: each stage's optimizer state is sharded over its replicas (ZeRO-1: train with
            :func:`dapple.shard_optimizer`): a stage on r replicas holds 2 + (``optimizer_factor`` - 2) / r bytes per
            parameter byte, so plans that fit only that way are found. Recorded as ``Plan.shard_optimizer``.

    Returns:
        The Plan, with its estimate and ``meta`` (what was searched, how, and what it proves).

    Raises:
        ValueError: a bad argument (naming it); NoFitError (a ValueError): no plan fits in device memory.
        TypeError: ``profile`` or ``cluster`` is not a loaded Profile / Cluster.
    """
    if schedule in (AUTO, *SPLIT_BACKWARD, *CHUNKED_SCHEDULES) or \
            _check_activations(recompute, mixed_precision) == "auto":
        return _where_memory_binds(dict(locals())) if recompute == "auto" else _settled(dict(locals()))
    return _planned(**locals())


def _planned(profile: "Profile", cluster: "Cluster", global_batch_size: int, micro_batch_size: int | None, *,
             model: str, overlap: bool, schedule: str, warmup_policy: str | None, optimizer_factor: float, beam: int,
             micro_batch_sizes: Sequence[int] | None, max_stages: int | None, search: str,
             time_limit: float | str | None, gap: float, verify: int, workers: int | str, recompute: Recompute,
             mixed_precision: str | None, shard_optimizer: bool) -> Plan:
    """:func:`plan` with ``recompute`` settled: the DP's search of every micro-batch size (it models dapple's
    1F1B), then the final choice among its candidates, simulated under ``schedule`` ("auto": dapple and zb-h1)."""
    t0 = time.perf_counter()
    search, time_limit = _checked(profile, cluster, global_batch_size, model=model, schedule=schedule,
                                  warmup_policy=warmup_policy, optimizer_factor=optimizer_factor, beam=beam,
                                  max_stages=max_stages, search=search, time_limit=time_limit, gap=gap, verify=verify,
                                  overlap=overlap)
    flag("shard_optimizer", shard_optimizer, "shard each stage's optimizer state over its replicas")
    sizes = _micro_batch_sizes(global_batch_size, micro_batch_size, micro_batch_sizes)
    config = SearchConfig(model=model, overlap=overlap, warmup_policy=warmup_policy if model == "refined" else None,
                          optimizer_factor=optimizer_factor, beam=beam, max_stages=max_stages,
                          partial_kinds=1 if search == "compact" else None, gap=float(gap), recompute=recompute,
                          mixed_precision=mixed_precision, shard_optimizer=shard_optimizer)
    searches = _searches(profile, cluster, global_batch_size, sizes, config)
    auto = workers == "auto"
    workers = resolve_workers(workers, len(searches), search == "compact")
    spare = resolve_workers("auto", len(searches), True) if auto else workers  # what forking would use
    workers, seeding, seeds = _seeded(searches, workers, spare)
    deadline = t0 + time_limit if time_limit is not None else None
    # full search: each other size's own best within VERIFY_WITHIN is a candidate too (the compact search of large
    # clusters keeps the tight bound: it would take far longer)
    within = tuning.TUNING.verify_within
    widen = 1 + within if verify and search == "full" else 1.0
    early = time_limit is not None and seeding > tuning.TUNING.early_bounds * time_limit  # (a deadline)
    searched = _search(searches, workers, deadline, widen, early)
    _certify(searches, searched, gap)
    if searched.found is None:
        raise NoFitError(f"no plan of {profile.model} fits on {cluster.name or 'the cluster'} "
                         f"({cluster.num_devices} devices of {cluster.device_memory / 1e9:.3g} GB) with micro-batch "
                         f"sizes {sorted(sizes)}: even the best split exceeds device memory; try a larger cluster or "
                         f"smaller micro-batches{'' if mixed_precision else ', or mixed_precision=bf16'}"
                         f"{'' if shard_optimizer else ', or shard_optimizer=True'}")
    cands = _candidates(searched, seeds)
    every = every_candidate(searches) if verify else None  # a small instance: the simulator judges every plan
    picked = choose(profile, cluster, global_batch_size, cands if every is None else cands[:1] + every, model=model,
                    overlap=overlap, schedule=schedule, warmup_policy=warmup_policy, optimizer_factor=optimizer_factor,
                    verify=verify if every is None else len(every) + 1, deadline=deadline, workers=workers,
                    spare=spare, within=within if every is None else INF, recompute=recompute,
                    mixed_precision=mixed_precision, shard_optimizer=shard_optimizer)
    stages = _stages(profile, cluster, global_batch_size, picked, optimizer_factor, config)
    schedule = picked.chosen.schedule  # "auto": the simulator's choice (dapple where nothing was simulated)
    est = evaluate(profile, cluster, stages, global_batch_size, picked.chosen.micro_batch_size, schedule=schedule,
                   warmup_policy=picked.chosen.warmup_policy, optimizer_factor=optimizer_factor, model=model,
                   overlap=overlap, mixed_precision=mixed_precision, shard_optimizer=shard_optimizer)
    meta = _meta(profile, cluster, config, searches, searched, picked, search=search, time_limit=time_limit,
                 gap=gap, workers=workers)
    meta["planning_time_s"] = round(time.perf_counter() - t0, 4)
    return Plan(global_batch_size=global_batch_size, micro_batch_size=picked.chosen.micro_batch_size, stages=stages,
                schedule=schedule, warmup_policy=picked.chosen.warmup_policy, layer_names=list(profile.layer_names),
                estimate=est, meta=meta, mixed_precision=mixed_precision, shard_optimizer=shard_optimizer)


def _settled(args: dict) -> Plan:
    """schedule "auto" or a split-backward one (zb-h1): the plan :func:`_planned` finds (``args``: plan()'s
    arguments; its DP models dapple's 1F1B, its simulator judges the candidates under the schedules asked for),
    its schedule then settled by ``judge.settle_schedule``: "auto" takes zb-h1 where the simulator finds
    it faster (only where every stage can hold K_0 micro-batches until their W; ``meta["schedule_choice"]``
    records it); zb-h1 asked for by name must fit so (NoFitError naming the stage). Re-estimated (and
    re-simulated if it was) where that changed the schedule. A zb-h1 plan claims no lower bound: the search's
    is one of the 1F1B model (``meta["search_schedule"]``). Then (refined model) "auto" also simulates the plan's
    two-chunk variants under interleaved-1f1b and zb-v and takes one that is faster (chunked.settle_chunks;
    ``SearchTuning.chunked_variants``); a schedule of chunks by name: the fastest variant of the search's plan."""
    named = args["schedule"] in CHUNKED_SCHEDULES  # chunks asked for by name: the search's plan is a start
    p = _planned(**(dict(args, schedule="dapple") if named else args))
    profile, cluster = args["profile"], args["cluster"]
    if named:
        schedule, record = p.schedule, None
    else:
        schedule, record = settle_schedule(args["schedule"], p, profile, cluster,
                                           overlap=bool(p.meta.get("overlap")),
                                           optimizer_factor=args["optimizer_factor"])
    meta = {**p.meta, **({"schedule_choice": record} if record is not None else {})}
    if schedule in SPLIT_BACKWARD:
        meta.pop("latency_lower_bound_ms", None)
        meta["search_schedule"] = "dapple"
    if schedule == p.schedule:
        p.meta = meta
        out = p
    else:
        est = evaluate(profile, cluster, p, schedule=schedule, optimizer_factor=args["optimizer_factor"])
        out = Plan(p.global_batch_size, p.micro_batch_size, p.stages, schedule=schedule,
                   warmup_policy=p.warmup_policy, layer_names=p.layer_names, estimate=est, meta=meta,
                   mixed_precision=p.mixed_precision, shard_optimizer=p.shard_optimizer)
        if "simulated_ms" in meta:
            meta["simulated_ms"] = round(simulate(out, profile, cluster,
                                                  overlap=bool(meta.get("overlap"))).latency_ms, 4)
    tries = chunked_schedules(args["schedule"]) if args["model"] == "refined" else ()
    if named or (tries and tuning.TUNING.chunked_variants):
        return settle_chunks(out, args, tries, named)
    return out


def _where_memory_binds(args: dict) -> Plan:
    """recompute="auto": the plans :func:`plan` (``args``: its arguments) makes without recomputation and with it in
    every stage, each stage of each then recomputing as model.evaluate.auto_recompute says (where its K_i would
    have to drop otherwise, if that is faster; a zb-h1 plan whose stages need it to hold K_0 keeps it as planned);
    the faster of the two (the one without on ties)."""
    t0 = time.perf_counter()
    plans, errors = [], []
    for rc in (False, True):
        try:
            found = plan(**{**args, "recompute": rc})
        except NoFitError as e:  # no plan fits that way
            errors.append(e)
            continue
        try:
            found = _reflagged(found, args["profile"], args["cluster"], args["optimizer_factor"])
        except NoFitError:  # a zb-h1 stage whose K_i fits may still need recomputation to hold K_0: keep it
            pass
        plans.append(found)
    if not plans:
        raise errors[0]
    best = min(plans, key=_estimated_ms)  # (the first on ties)
    # two searches under two pricings: neither one's lower bound holds for the plans "auto" may make
    best.meta.pop("latency_lower_bound_ms", None)
    best.meta.update(recompute="auto", planning_time_s=round(time.perf_counter() - t0, 4))
    return best


def _reflagged(p: Plan, profile: "Profile", cluster: "Cluster", optimizer_factor: float) -> Plan:
    """``p`` with each stage recomputing as auto_recompute says (K_i from its policy again), re-estimated (and
    re-simulated if it was simulated and a stage changed); a plan of chunks as it is (its chunks recompute as
    planned: all or none)."""
    if p.chunks.chunks > 1:
        return p
    overlap = bool(p.meta.get("overlap"))
    est = evaluate(profile, cluster, [Stage(s.layers, s.devices) for s in p.stages], p.global_batch_size,
                   p.micro_batch_size, schedule=p.schedule, warmup_policy=p.warmup_policy,
                   optimizer_factor=optimizer_factor, model=p.meta.get("latency_model"), overlap=overlap,
                   recompute="auto", mixed_precision=p.mixed_precision, shard_optimizer=p.shard_optimizer)
    stages = [Stage(s.layers, s.devices, d["warmup"], d.get("recompute", False))
              for s, d in zip(p.stages, est.details["stages"])]
    out = Plan(p.global_batch_size, p.micro_batch_size, stages, schedule=p.schedule, warmup_policy=p.warmup_policy,
               layer_names=p.layer_names, estimate=est, meta=dict(p.meta), mixed_precision=p.mixed_precision,
               shard_optimizer=p.shard_optimizer)
    changed = [(s.warmup, s.recompute) for s in stages] != [(s.warmup, s.recompute) for s in p.stages]
    if changed and "simulated_ms" in out.meta:
        out.meta["simulated_ms"] = round(simulate(out, profile, cluster, overlap=overlap).latency_ms, 4)
    return out


def _estimated_ms(p: Plan) -> float:
    """A plan's modelled ms (plan() sets its estimate)."""
    if p.estimate is None:
        raise ValueError(f"a plan without its estimate: {p}")
    return p.estimate.latency_ms


def _check_activations(recompute: object, mixed_precision: str | None) -> object:
    """``recompute``, or ValueError naming ``recompute`` or ``mixed_precision`` unless plan() knows it."""
    recompute_mode(recompute)
    activation_scale(mixed_precision)  # (checks it)
    return recompute


def _checked(profile: "Profile", cluster: "Cluster", g: int, *, model: str, schedule: str,
             warmup_policy: str | None, optimizer_factor: float, beam: int, max_stages: int | None, search: str,
             time_limit: float | str | None, gap: float, verify: int, overlap: bool) -> tuple[str, float | None]:
    """plan()'s arguments checked (a clear error naming a bad value); returns the search and time limit that
    "auto" stands for."""
    profile_and_cluster("plan", profile, cluster)
    positive_int("global_batch_size", g)
    positive_int("beam", beam)
    non_negative_int("verify", verify)
    number("optimizer_factor", optimizer_factor, positive=True)
    if max_stages is not None:
        positive_int("max_stages", max_stages)
    if time_limit is not None and time_limit != "auto":
        number("time_limit", time_limit)
    if model not in MODELS:
        raise ValueError(f"model: expected one of {MODELS}, got {model!r}")
    if schedule not in SCHEDULES and schedule != AUTO:
        raise ValueError(f"schedule: expected one of {SCHEDULES} or {AUTO!r}, got {schedule!r}")
    if schedule in CHUNKED_SCHEDULES and model != "refined":
        raise ValueError(f"schedule={schedule!r}: a plan of chunks is priced by simulating it; use model='refined' "
                         f"(got model={model!r})")
    if not is_real(gap) or not 0 <= gap < 1:
        raise ValueError(f"gap: expected a fraction in [0, 1), e.g. 0.01 for 1%, got {gap!r}")
    if search not in SEARCHES:
        raise ValueError(f"search: expected one of {SEARCHES}, got {search!r}")
    if search == "auto":
        search = "compact" if cluster.servers > tuning.TUNING.compact_above else "full"
    if isinstance(time_limit, str):  # "auto" (number() refused any other)
        time_limit = tuning.TUNING.compact_time_limit if search == "compact" else None
    if warmup_policy is not None and warmup_policy not in WARMUP_POLICIES:
        raise ValueError(f"warmup_policy: expected one of {WARMUP_POLICIES} or None, got {warmup_policy!r}")
    flag("overlap", overlap, "AllReduce overlapped with the last backward")
    return search, time_limit


def _micro_batch_sizes(g: int, micro_batch_size: int | None, micro_batch_sizes: Sequence[int] | None) -> list[int]:
    """The micro-batch sizes to search: the one given, those given, or every divisor of the global batch."""
    if micro_batch_size is not None and micro_batch_sizes is not None:
        raise ValueError(f"give micro_batch_size ({micro_batch_size!r}) or micro_batch_sizes "
                         f"({micro_batch_sizes!r}), not both")
    if micro_batch_size is not None:
        if not is_int(micro_batch_size, 1) or g % micro_batch_size:
            raise ValueError(f"micro_batch_size: expected a positive divisor of the global batch {g}, "
                             f"got {micro_batch_size!r}")
        return [micro_batch_size]
    if micro_batch_sizes is not None:
        bad = [x for x in micro_batch_sizes if not is_int(x, 1) or g % x]
        if bad or not micro_batch_sizes:
            raise ValueError(f"micro_batch_sizes: expected divisors of the global batch {g}, got "
                             f"{list(micro_batch_sizes)!r}" + (f" ({bad} are not)" if bad else ""))
        return sorted(set(micro_batch_sizes))
    return divisors(g)


def _searches(profile: "Profile", cluster: "Cluster", g: int, sizes: list[int],
              config: SearchConfig) -> list[DPSearch]:
    """One search per micro-batch size that can occupy every device, larger sizes first (they win ties)."""
    out = [DPSearch(profile, cluster, g, b, config, INF) for b in sorted(sizes, reverse=True)
           if can_occupy(cluster.num_devices, profile.num_layers, b, config.max_stages)]
    if not out:  # a plan uses every device: at most `depth` stages of at most b replicas each
        depth = most_stages(profile.num_layers, config.max_stages)
        raise ValueError(f"micro-batch sizes {sorted(sizes)}: none can occupy the {cluster.num_devices} devices "
                         f"of {cluster.name or 'the cluster'} in at most {depth} stages ({profile.num_layers} layers"
                         f"{'' if config.max_stages is None else f', max_stages={config.max_stages}'}); a stage has "
                         f"at most one replica per micro-batch row: need a micro-batch of at least "
                         f"{-(-cluster.num_devices // depth)} rows")
    return out


def _seeded(searches: list[DPSearch], workers: int, spare: int) -> tuple[int, float, list[Candidate]]:
    """Every size's seeds, the promising ones refined; the searches sorted most promising first (their plans bound
    the others' search). Returns the workers from now on (auto, a full search whose seeds took long: so will its
    searches, which then fork too; the plan is the same), the seconds the seeds took, and the seed plans."""
    t_seed = time.perf_counter()
    in_workers(searches, workers, DPSearch.seed)
    seeding = time.perf_counter() - t_seed
    if workers < spare and seeding > tuning.TUNING.fork_worth:
        workers = spare
    refine_promising(searches, workers)
    seeds = [Candidate(s.best.latency, s.b, s.best.found.spans, s.best.found.policies)
             for s in searches if s.best.found is not None]
    searches.sort(key=lambda s: s.best.latency)
    return workers, seeding, seeds


@dataclass
class _Searched:
    """What the sizes' searches found: the best plan, each size's own best, the sizes searched, whether all
    finished."""

    found: SearchResult | None = None
    bests: list[Candidate] = field(default_factory=list)
    tried: list[int] = field(default_factory=list)
    complete: bool = True


def _search(searches: list[DPSearch], workers: int, deadline: float | None, widen: float,
            early: bool) -> _Searched:
    """The DP of every size in two waves, each searched side by side by the workers: the promising sizes (seeds
    within SearchTuning.refine_within of the best), bounded by the best seed plan x ``widen``; then the rest,
    bounded by the best plan of the first wave (the sizes of a wave share nothing while they run: the plan does not
    depend on the workers). ``early``: the sizes that may start after the deadline make their root bounds (for the lower
    bound) first, below the first wave's bound, and then search only if time is left."""
    lead, near = searches[0].best.latency, 1 + tuning.TUNING.refine_within
    waves = [[s for s in searches if s.best.latency <= lead * near],
             [s for s in searches if s.best.latency > lead * near]]
    if early:
        late = waves[0][workers:] + waves[1]
        _bound_by(late, searches[0], lead * widen)
        in_workers(late, workers, DPSearch.bound_tables)
    out = _Searched()
    for wave in waves:
        _bound_by(wave, searches[0], (out.found.latency if out.found else lead) * widen)
        for s in wave:
            s.deadline = deadline
        in_workers(wave, workers, DPSearch.run)
        for s in wave:
            out.complete = out.complete and s.complete
            out.tried.append(s.b)
            res = s.result()
            if res is not None:
                out.bests.append(Candidate(res.latency, res.micro_batch_size, res.spans, res.policies))
                if out.found is None or res.latency < out.found.latency:
                    out.found = res
    return out


def _certify(searches: list[DPSearch], searched: _Searched, gap: float) -> None:
    """Small instances: every plan of each size below the best so far enumerated (DPSearch.certify: what makes
    the lower bound the model's optimum); a plan the DP missed becomes its size's best."""
    for s in searches:
        before = s.best.latency
        bar = (searched.found.latency if searched.found is not None else INF) / (1 + gap)
        if not s.certify(bar) or s.best.latency >= before:
            continue
        res = s.result()
        if res is None:
            raise RuntimeError(f"micro-batch size {s.b}: certify() found a better plan but the search holds none")
        searched.bests = [c for c in searched.bests if c.micro_batch_size != s.b] + [
            Candidate(res.latency, res.micro_batch_size, res.spans, res.policies)]
        if searched.found is None or res.latency < searched.found.latency:
            searched.found = res


def _bound_by(wave: list[DPSearch], lead: DPSearch, bound: float) -> None:
    """The sizes' incumbent (but ``lead``'s): ``bound`` where their own best is not below it."""
    for s in wave:
        if s is not lead and s.best.latency >= bound:
            s.set_best(bound, None)


def _candidates(searched: _Searched, seeds: list[Candidate]) -> list[Candidate]:
    """The final choice's candidates: the DP's plan, then the best plan of every other micro-batch size and the
    seed plans of every size, most promising first."""
    found = searched.found
    if found is None:
        raise RuntimeError("_candidates: the search found no plan")
    others = [c for c in searched.bests if c.micro_batch_size != found.micro_batch_size] + seeds
    return [Candidate(found.latency, found.micro_batch_size, found.spans, found.policies)] + sorted(
        others, key=lambda c: (c.latency, c.micro_batch_size))


def _stages(profile: "Profile", cluster: "Cluster", g: int, picked: Verdict, optimizer_factor: float,
            config: SearchConfig) -> list[Stage]:
    """The chosen plan's stages on concrete devices, with their K_i and recompute flags."""
    b, spans, policy = picked.chosen.micro_batch_size, picked.chosen.spans, picked.chosen.warmup_policy
    cm = CostModel(profile, cluster, b, optimizer_factor=optimizer_factor, recompute=config.recompute,
                   mixed_precision=config.mixed_precision, shard_optimizer=config.shard_optimizer)
    pc, _ = pipeline_costs(cm, spans, g // b, policy)
    devs = devices_of(spans, cluster)
    if pc.recompute is None:
        raise RuntimeError("pipeline_costs gave no recompute flags")
    return [Stage((a, c), ds, k, rc) for (a, c, _), ds, k, rc in zip(spans, devs, pc.K, pc.recompute)]


def _meta(profile: "Profile", cluster: "Cluster", config: SearchConfig, searches: list[DPSearch],
          searched: _Searched, picked: Verdict, *, search: str, time_limit: float | None, gap: float,
          workers: int) -> dict:
    """The Plan's meta: what was searched and how, what the search proves, what the simulator said."""
    found = searched.found
    if found is None:
        raise RuntimeError("_meta: the search found no plan")
    meta = {"model": profile.model, "cluster": cluster.name or "", "planner": "dapple",
            "latency_model": config.model, "overlap": config.overlap, "placement": list(picked.chosen.policies),
            "micro_batch_sizes_tried": sorted(searched.tried), "dp_states": found.states,
            "dp_transitions": found.transitions, "search": search, "search_complete": searched.complete,
            "time_limit_s": time_limit, "workers": max(workers, picked.workers),
            # the whole Cluster document and where the profile is: `dapple simulate plan.yaml` needs no more
            "cluster_spec": cluster.to_dict(), **profile.source()}
    if gap:
        meta["gap"] = gap
    # what the search proves: no modelled L below this (every size enumerated: its best plan's)
    meta["latency_lower_bound_ms"] = round(lower_bound(searches, found.latency, gap), 4)
    if picked.simulated_ms is not None:
        meta["simulated_ms"] = round(picked.simulated_ms, 4)
        meta["candidates_simulated"] = picked.simulated
        meta["candidates_skipped"] = picked.listed - picked.simulated  # their floor was above the best simulated
    return meta


def refine_promising(searches: Sequence[DPSearch], workers: int = 1) -> None:
    """Local search over the cuts of the promising sizes' seeds (DPSearch.refine_seeds), most promising first: a
    size whose best seed is more than SearchTuning.refine_within above the best plan so far (refined seeds included)
    is not refined. ``workers`` sizes the rule may still take are refined side by side, and the rule keeps the
    refinements it would have made one at a time (the same bests): a later one of a batch that the earlier ones'
    refinements put out of reach stays as it was (what its worker made is not adopted)."""
    order = sorted(searches, key=lambda s: s.best.latency)
    best, i = INF, 0
    while i < len(order) and _promising(order[i], best):
        batch = order[i:i + max(1, workers)]
        batch = batch[:next((k for k, s in enumerate(batch) if not _promising(s, best)), len(batch))]
        made = forked_map(lambda s: s.refine_seeds(), batch, workers, _doing("refine_seeds", batch))
        for s, progress in zip(batch, made):
            if not _promising(s, best):
                break  # (nor any after it: further off, and the best only falls)
            s.adopt(progress)
            best = min(best, s.best.latency)
        i += len(batch)


def _promising(search: DPSearch, best: float) -> bool:
    """refine_promising's rule: the size's best so far is within SearchTuning.refine_within of ``best``."""
    return search.best.latency <= best * (1 + tuning.TUNING.refine_within)


def in_workers(searches: Sequence[DPSearch], workers: int, step: Callable[[DPSearch], Progress]) -> None:
    """``step`` (a DPSearch method) of every search, ``workers`` side by side, in order (the most promising first);
    each search adopts what its step made. The searches share nothing while they run (each keeps the incumbent it
    was given): the plan depends neither on timing nor on the number of workers."""
    for search, progress in zip(searches, forked_map(step, searches, workers, _doing(step.__name__, searches))):
        search.adopt(progress)


def _doing(step: str, searches: Sequence[DPSearch]) -> str:
    """What the workers are doing, for their errors."""
    return f"{step}() of micro-batch sizes {[s.b for s in searches]}"


def lower_bound(searches: Sequence[DPSearch], best: float, gap: float = 0.0) -> float:
    """A lower bound on the modelled L of every plan, after the searches (one per micro-batch size; the others fit
    no device) ran: a size whose every plan below ``best`` / (1 + ``gap``) was enumerated (DPSearch.certify)
    has none below that; any other contributes its root bound (DPSearch.root_bound: the rest bounds at the root,
    over the stages below the bar the search started with, and once it tightened them the same below its bar
    then and the period bound), whatever its search found: the DP keeps one prefix per state and tries only
    Fresh/Append/Scatter placements in two replica orders, so a finished search proves no more than that."""
    return min([best / (1 + gap)] + [s.root_bound for s in searches if not s.certified])
