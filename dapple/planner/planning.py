"""``dapple.plan``: the DP of formulas 4-5 over micro-batch sizes, warmup policy choice, and the Plan it makes."""

from __future__ import annotations

import time
from itertools import takewhile
from typing import TYPE_CHECKING, Sequence

from ..core.checks import flag, is_int, is_real, non_negative_int, number, positive_int
from ..core.plan import Plan, Stage
from ..core.schedule import SCHEDULES, WARMUP_POLICIES
from .checks import profile_and_cluster
from .model.cost import CostModel
from .model.evaluate import MODELS, evaluate, pipeline_costs
from .search import choice, forking
from .search.choice import choose, devices_of
from .search.dp import _DP, INF, SearchResult, _gc_paused, can_occupy, most_stages
from .search.forking import in_workers, resolve_workers

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..core.profile import Profile

SEARCHES = ("auto", "full", "compact")
COMPACT_ABOVE = 4  # search="auto": servers above which the compact search is used
EARLY_BOUNDS = 0.02  # seeds taking this share of time_limit: the sizes that may start late bound themselves first
REFINE_WITHIN = 0.05  # micro-batch sizes whose best seed plan is within this of the best plan so far get refined seeds
COMPACT_TIME_LIMIT = 60.0  # time_limit="auto": seconds the compact search may take (the full search: no limit)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@_gc_paused()  # the seeds and the simulator's checks allocate as much as the search
def plan(profile: "Profile", cluster: "Cluster", global_batch_size: int, micro_batch_size: int | None = None, *,
         model: str = "refined", overlap: bool = False, schedule: str = "dapple", warmup_policy: str | None = None,
         optimizer_factor: float = 4.0, beam: int = 1, micro_batch_sizes: Sequence[int] | None = None,
         max_stages: int | None = None, search: str = "auto", time_limit: float | str | None = "auto",
         gap: float = 0.0, verify: int = 6, workers: int | str = "auto") -> Plan:
    """The plan minimising the modelled latency of one iteration of ``global_batch_size`` samples on ``cluster``,
    among the plans that use every device of it (a plan's device ids are the ranks 0..n-1 of the job that runs
    it). Where fewer devices may do better (a tiny global batch, very slow links), plan for a smaller Cluster
    too and compare the estimates.

    Searches stage splits, replication and Fresh/Append/Scatter placement by the DP of formulas 4-5
    (:func:`dp_search`) for each micro-batch size (the divisors of the global batch, or ``micro_batch_size``
    / ``micro_batch_sizes``). ``model``: "refined" (default: the model that tracks the event simulator, see
    :mod:`dapple.planner.model.refined`) or "paper" (formula 2 as printed); ``overlap``: the runtime overlaps
    gradient AllReduce with the last backward (DDP-style; dapple's runtime does, so pass True for a job it runs:
    the default, False, is formula 2's assumption). ``max_stages`` limits the pipeline depth. The
    warmup policy (A or B) is the better one under the refined model unless given (A on ties: it holds fewer
    activations), and K_i is recorded per stage. ``beam``: prefixes kept per DP state (the paper keeps 1).
    ``search``: "full" composes Fresh/Append/Scatter freely; "compact" keeps only placements after which all
    partly used servers are alike (same free devices, same replicas of the new stage): one partly used server
    (stages fill servers in turn, Append First's answer to fragmentation) or several used evenly (Scatter
    First's stages spread over servers), which is what makes 8 x 8 and larger clusters plannable in seconds
    for one micro-batch size (all divisors of a large global batch: minutes; bound it with ``time_limit``);
    "auto" (default): full up to 4 servers, compact above (benchmarks/compact_vs_full.py: what it gives up).
    ``time_limit`` (seconds) makes the search anytime: when it runs out, the best plan found so far is
    returned and ``plan.meta["search_complete"]`` is False (large clusters: see benchmarks/planning_time.py).
    "auto" (default): no limit for the full search, COMPACT_TIME_LIMIT = 60 s for the compact one (128 x 8 had not
    finished after 10 minutes; ``meta["latency_lower_bound_ms"]`` says how far from the optimum the plan can be;
    it returned after 60.6 s); None or ``math.inf``: no limit.
    ``gap`` (a fraction, e.g. 0.01) stops proving sooner: the search drops whatever cannot beat the best plan
    found by more than this, so the plan is within (1 + gap) of the best the search would find without it (a
    branch-and-bound's optimality gap; the model's own error against the simulator is a few percent).
    ``verify``: the final choice among the DP's plan, the best plan of each other micro-batch size (full
    search) and the even-split plans of the sizes (the first ``verify`` of them modelled within choice.VERIFY_WITHIN =
    10% of the DP's plan, x warmup policies A and B, but not a policy modelled more than 10% above the other on
    the same plan) is made by the event simulator, the judge of the model (0:
    trust the model; skipped above choice.SIMULATE_LIMIT devices x micro-batches); ``meta`` records it. The model's
    median error against the simulator is 0.1%, its p90 3.4% to 5.0% (benchmarks/estimate_vs_simulator.py): a plan
    modelled 10% slower seldom simulates faster (benchmarks/planner_regret.py: what the choice gains).
    ``workers``: processes searching micro-batch sizes side by side (forked: Linux only; the plan is the same for
    any number); "auto" (default): one per core for the compact search (a large cluster: seconds per size,
    benchmarks/planning_time.py: 8x8 on 2 cores); the full search runs in-process (a fork costs more than a small
    search) unless its seeds took forking.FORK_WORTH = 0.1 s (resnet50 on 2x8: 9.1 -> 5.4 s on 2 cores), and
    its candidates' simulations likewise unless they would take that long (bert_48 at 128 on 2x8: 0.63 -> 0.55 s).
    Workers that use no CPU for forking.WORKER_STUCK = 30 s with work pending are stuck (forking a multi-threaded
    process can deadlock): they are ended and plan() raises RuntimeError (as for a worker that dies).
    Raises ValueError when no plan fits in device memory.
    """
    t0 = time.perf_counter()
    g = global_batch_size
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
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    if not is_real(gap) or not 0 <= gap < 1:
        raise ValueError(f"gap: expected a fraction in [0, 1), e.g. 0.01 for 1%, got {gap!r}")
    if search not in SEARCHES:
        raise ValueError(f"search: expected one of {SEARCHES}, got {search!r}")
    if search == "auto":
        search = "compact" if cluster.servers > COMPACT_ABOVE else "full"
    if time_limit == "auto":
        time_limit = COMPACT_TIME_LIMIT if search == "compact" else None
    if warmup_policy is not None and warmup_policy not in WARMUP_POLICIES:
        raise ValueError(f"warmup_policy: expected one of {WARMUP_POLICIES} or None, got {warmup_policy!r}")
    flag("overlap", overlap, "AllReduce overlapped with the last backward")
    if micro_batch_size is not None and micro_batch_sizes is not None:
        raise ValueError(f"give micro_batch_size ({micro_batch_size!r}) or micro_batch_sizes "
                         f"({micro_batch_sizes!r}), not both")
    if micro_batch_size is not None:
        if not is_int(micro_batch_size, 1) or g % micro_batch_size:
            raise ValueError(f"micro_batch_size: expected a positive divisor of the global batch {g}, "
                             f"got {micro_batch_size!r}")
        candidates = [micro_batch_size]
    elif micro_batch_sizes is not None:
        bad = [x for x in micro_batch_sizes if not is_int(x, 1) or g % x]
        if bad or not micro_batch_sizes:
            raise ValueError(f"micro_batch_sizes: expected divisors of the global batch {g}, got "
                             f"{list(micro_batch_sizes)!r}" + (f" ({bad} are not)" if bad else ""))
        candidates = sorted(set(micro_batch_sizes))
    else:
        candidates = divisors(g)
    depth = most_stages(profile.num_layers, max_stages)
    dps = []
    for b in sorted(candidates, reverse=True):  # larger micro-batches first: they win ties (all divide g)
        if can_occupy(cluster.num_devices, profile.num_layers, b, max_stages):
            dps.append(_DP(profile, cluster, g, b, model, overlap, warmup_policy if model == "refined" else None,
                           optimizer_factor, beam, INF, max_stages, 1 if search == "compact" else None, float(gap)))
    if not dps:  # a plan uses every device: at most `depth` stages of at most b replicas each
        raise ValueError(f"micro-batch sizes {sorted(candidates)}: none can occupy the {cluster.num_devices} devices "
                         f"of {cluster.name or 'the cluster'} in at most {depth} stages ({profile.num_layers} layers"
                         f"{'' if max_stages is None else f', max_stages={max_stages}'}); a stage has at most one "
                         f"replica per micro-batch row: need a micro-batch of at least "
                         f"{-(-cluster.num_devices // depth)} rows")
    auto = workers == "auto"
    workers = resolve_workers(workers, len(dps), search == "compact")
    spare = resolve_workers("auto", len(dps), True) if auto else workers  # what forking would use
    t_seed = time.perf_counter()
    in_workers(dps, workers, "seed")
    seeding = time.perf_counter() - t_seed
    if workers < spare and seeding > forking.FORK_WORTH:
        workers = spare  # auto, a full search whose seeds took long: so will its searches (the plan is the same)
    refine_promising(dps, workers)
    seeds = [(dp.best[0], dp.b, dp.best[1]) for dp in dps if dp.best[1] is not None]
    dps.sort(key=lambda dp: dp.best[0])  # most promising first: its plans bound the others' search
    deadline = t0 + time_limit if time_limit is not None else None
    complete = True
    found: SearchResult | None = None
    tried, bests = [], []
    # full search: each other size's own best within VERIFY_WITHIN is a candidate too (on 2x8, bert_48 plans in
    # 0.18 s instead of 0.11 s; the compact search of large clusters keeps the tight bound: 8x8 would take 8x longer)
    widen = 1 + choice.VERIFY_WITHIN if verify and search == "full" else 1.0
    # two waves, each searched side by side by the workers: the promising sizes (refine_promising's: seeds within
    # REFINE_WITHIN of the best), bounded by the best seed plan; then the rest, bounded by the best plan of the
    # first wave (the sizes of a wave share nothing while they run: the plan does not depend on the workers)
    lead = dps[0].best[0]
    waves = [[dp for dp in dps if dp.best[0] <= lead * (1 + REFINE_WITHIN)],
             [dp for dp in dps if dp.best[0] > lead * (1 + REFINE_WITHIN)]]

    def bound_by(wave, bound):  # the sizes' incumbent: the bound where their own best is not below it
        for dp in wave:
            if dp is not dps[0] and dp.best[0] >= bound:
                dp.set_best(bound, None)
    if deadline is not None and seeding > EARLY_BOUNDS * time_limit:
        # a search this long may reach its deadline before the later sizes start: they make their root bounds
        # (for the report's lower bound) now, below the first wave's bound, and then search only if time is left
        # (128 x 8 at 60 s: returned 3.9 s past the limit, 6% of it, building them after the deadline)
        late = waves[0][workers:] + waves[1]
        bound_by(late, lead * widen)
        in_workers(late, workers, "bound_tables")
    for wave in waves:
        bound_by(wave, (found.latency if found else lead) * widen)
        for dp in wave:
            dp.deadline = deadline
        in_workers(wave, workers, "run")
        for dp in wave:
            complete = complete and dp.complete
            tried.append(dp.b)
            if dp.best[1] is not None:
                spans, policies, pol = dp.best[1]
                bests.append((dp.best[0], dp.b, (spans, policies)))
                if found is None or dp.best[0] < found.latency:
                    found = SearchResult(dp.best[0], spans, policies, pol, dp.b, dp.states, dp.transitions)
    if found is None:
        raise ValueError(f"no plan of {profile.model} fits on {cluster.name or 'the cluster'} "
                         f"({cluster.num_devices} devices of {cluster.device_memory / 1e9:.3g} GB) with micro-batch "
                         f"sizes {sorted(candidates)}: even the best split exceeds device memory; "
                         f"try a larger cluster or smaller micro-batches")
    # the candidates: the DP's plan, then the best plan of every other micro-batch size and the even-split seed
    # plans of every size, most promising first
    cands = [(found.latency, found.micro_batch_size, (found.spans, found.policies))]
    cands += sorted([c for c in bests if c[1] != found.micro_batch_size] +
                    [(lat, b, (sp, pols)) for lat, b, (sp, pols, _) in seeds], key=lambda c: (c[0], c[1]))
    chosen, simulated, n_listed, n_sim, sim_workers = choose(profile, cluster, g, cands, model, overlap, schedule,
                                                             warmup_policy, optimizer_factor, verify, deadline,
                                                             workers, spare)
    b, spans, policies, policy = chosen
    M = g // b
    cm = CostModel(profile, cluster, b, optimizer_factor=optimizer_factor)
    pc, D = pipeline_costs(cm, spans, M, policy)
    devs = devices_of(spans, cluster)
    stages = [Stage((a, c), ds, k) for (a, c, _), ds, k in zip(spans, devs, pc.K)]
    est = evaluate(profile, cluster, stages, g, b, schedule=schedule, warmup_policy=policy,
                   optimizer_factor=optimizer_factor, model=model, overlap=overlap)
    meta = {"model": profile.model, "cluster": cluster.name or "", "planner": "dapple",
            "latency_model": model, "overlap": overlap, "placement": list(policies),
            "micro_batch_sizes_tried": sorted(tried), "dp_states": found.states,
            "dp_transitions": found.transitions, "search": search, "search_complete": complete,
            "time_limit_s": time_limit, "workers": max(workers, sim_workers),
            # the whole Cluster document and where the profile is: `dapple simulate plan.yaml` needs no more
            "cluster_spec": cluster.to_dict(), **profile.source()}
    if gap:
        meta["gap"] = gap
    # what the search proves: no modelled L below this (a finished full search: its best plan's)
    meta["latency_lower_bound_ms"] = round(lower_bound(dps, found.latency, search == "full", gap), 4)
    if simulated is not None:
        meta["simulated_ms"] = round(simulated, 4)
        meta["candidates_simulated"] = n_sim
        meta["candidates_skipped"] = n_listed - n_sim  # their floor was above the best simulated
    meta["planning_time_s"] = round(time.perf_counter() - t0, 4)
    return Plan(global_batch_size=g, micro_batch_size=b, stages=stages, schedule=schedule, warmup_policy=policy,
                layer_names=list(profile.layer_names), estimate=est, meta=meta)


def refine_promising(dps: Sequence[_DP], workers: int = 1) -> None:
    """Local search over the cuts of the promising sizes' seeds (_DP.refine_seeds, ~0.17 s each on 8x8), most
    promising first: a size whose best seed is more than REFINE_WITHIN above the best plan so far (refined seeds
    included) is not refined. ``workers`` sizes the rule may still take are refined side by side, and the rule keeps
    the refinements it would have made one at a time (the same bests; 8x8: micro-batches 8 and 16, not 4)."""
    order = sorted(dps, key=lambda dp: dp.best[0])
    best = INF

    def takes(dp) -> bool:  # the rule, with the best so far
        return dp.best[0] <= best * (1 + REFINE_WITHIN)

    def keeps(dp, kept=None) -> bool:  # in order: whether the rule takes dp's refinement (in_workers': ``kept``)
        nonlocal best
        if not takes(dp):
            return False  # (nor any after it: further off, and the best only falls)
        best = min(best, dp.best[0] if kept is None else kept[0][0])
        return True
    i = 0
    while i < len(order) and takes(order[i]):
        batch = list(takewhile(takes, order[i:i + max(1, workers)]))
        if len(batch) > 1:
            in_workers(batch, workers, "refine_seeds", keeps)
        else:
            batch[0].refine_seeds()
            keeps(batch[0])
        i += len(batch)


def lower_bound(dps: Sequence[_DP], best: float, exhaustive: bool = True, gap: float = 0.0) -> float:
    """A lower bound on the modelled L of every plan, after the searches ``dps`` (one per micro-batch size;
    the others fit no device) ran: a finished full search found all plans below ``best`` / (1 + ``gap``); an
    unfinished or compact one contributes its root bound ``_DP.root_bound``: the larger of Q[0][G] and Qar[0][G]
    (bounds.rest_bound: the least max-stage work of any split, with the backwards or the AllReduces after it,
    over the stages below the cut the search started with) and once the search tightened them the same below
    its cut then and the period bound (bounds.period_bound), which hold for plans below those cuts, each at
    least ``best`` / (1 + ``gap``)."""
    return min([best / (1 + gap)] + [dp.root_bound for dp in dps
                                     if not (dp.complete and exhaustive)])
