"""``dapple.plan``'s last word: the candidate plans it simulates, and the one the simulator finds fastest."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

from ...core.plan import Plan, Stage
from ..model.cost import CostModel, ServerLayout
from ..model.evaluate import pipeline_costs
from ..simulator.floor import latency_floor
from . import forking
from .forking import forked_map

if TYPE_CHECKING:
    from ...core.cluster import Cluster

VERIFY_WITHIN = 0.1  # plan(verify=): candidates modelled more than this fraction above the DP's plan are not simulated
SIMULATE_LIMIT = 50_000  # devices x micro-batches above which plan() does not simulate its candidates


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


def choose(profile, cluster, g, cands, model, overlap, schedule, warmup_policy, optimizer_factor, verify,
           deadline=None, workers=1, spare=None):
    """The DP's plan and warmup policy, or with ``verify`` the fastest in the event simulator among the first
    ``verify`` distinct candidates modelled within VERIFY_WITHIN of the DP's plan x warmup policies modelled within
    VERIFY_WITHIN of the candidate's better one (the DP's plan first: it wins ties; none listed past ``deadline``
    but the DP's own, and none at all where the search itself ran past it: the model's choice), simulated by
    ``workers`` processes (forking.forked_map), or by ``spare`` (more) once the first simulation took
    forking.FORK_WORTH / the rest; a candidate whose floor (floor.latency_floor) is above the best simulated
    before it is not simulated, for it could not win. Returns (chosen, its simulated ms, candidates listed, those
    simulated, the processes that ran them)."""
    from ..simulator.events import simulate

    pols = (warmup_policy,) if warmup_policy else ("A", "B")

    def priced(b, spans) -> dict:  # the candidate's pipeline costs per warmup policy (none where it does not fit)
        cm, out = CostModel(profile, cluster, b, optimizer_factor=optimizer_factor), {}
        for pol in pols:
            try:
                out[pol] = pipeline_costs(cm, spans, g // b, pol)[0]
            except ValueError:
                continue
        return out

    best_lat, b, (spans, policies) = cands[0]
    first = priced(b, spans)
    policy = warmup_policy
    if policy is None:  # the better policy under the refined model (formula 2 ignores K_i); A on ties
        lat = {pol: pc.latency("refined", overlap).total for pol, pc in first.items()}
        policy = "B" if lat["B"] < lat["A"] * (1 - 1e-3) else "A"
    chosen = (b, spans, policies, policy)
    too_big = cluster.num_devices * (g // b) > SIMULATE_LIMIT
    late = deadline is not None and time.perf_counter() > deadline  # (16 x 8: a simulation of 0.9 s after 60 s)
    if not verify or too_big or late:
        return chosen, None, 0, 0, 1
    seen, trials = set(), []  # (b, spans, policies, warmup policy, the plan to simulate), in order
    for lat, b, (spans, policies) in cands:
        if lat > best_lat * (1 + VERIFY_WITHIN):
            break  # the rest are sorted by modelled latency: all further off
        if (b, spans) in seen or len(seen) >= verify or (seen and deadline and time.perf_counter() > deadline):
            continue
        costs = first if not seen else priced(b, spans)
        seen.add((b, spans))
        # a policy the refined model puts more than VERIFY_WITHIN above the other on this plan is not simulated
        # (as for plans: benchmarks/planner_regret.py)
        lats = {pol: pc.latency("refined", overlap).total for pol, pc in costs.items()}
        for pol, pc in costs.items():
            if lats[pol] > min(lats.values()) * (1 + VERIFY_WITHIN):
                continue
            devs = devices_of(spans, cluster)
            trials.append((b, spans, policies, pol, Plan(g, b, [Stage((a, c), ds, k) for (a, c, _), ds, k in
                                                               zip(spans, devs, pc.K)],
                                                          schedule=schedule, warmup_policy=pol)))
    def simulated(trial) -> float:
        return simulate(trial[-1], profile, cluster, overlap=overlap).latency_ms
    took: dict = {}  # trial index -> simulated ms (one left out was skipped: its floor was above the best)
    if spare is not None and workers < spare and len(trials) > 2:  # auto: fork the rest if they take long
        t = time.perf_counter()
        took[0] = simulated(trials[0])  # (bert_48 at 128 on 2 x 8: 12 simulations of 27 ms)
        # the rest's ops: as many per device as micro-batches, g / b (trial[0]: b)
        if (time.perf_counter() - t) * sum(trials[0][0] / trial[0] for trial in trials[1:]) > forking.FORK_WORTH:
            workers = spare
    used = 1

    def settle(ks: list) -> None:  # simulate trials[k] for k in ks, ``workers`` side by side
        nonlocal used
        for k, t in zip(ks, forked_map(simulated, [trials[k] for k in ks], workers,
                                       f"simulating {len(trials)} candidate plans")):
            took[k] = t
        used = max(used, min(workers, len(ks)) if len(ks) > 1 else 1)

    def pick(chosen):  # the fastest simulated trial, in order (the DP's plan wins ties) and its ms
        best_sim = None
        for k, (b, spans, policies, pol, _) in enumerate(trials):
            t = took.get(k)
            if t is not None and (best_sim is None or t < best_sim * (1 - 1e-3) or (
                    t <= best_sim * (1 + 1e-3) and (b, spans, pol) == chosen[:2] + (chosen[3],))):
                best_sim = t
                chosen = (b, spans, policies, pol)
        return chosen, best_sim
    # first the DP's own plan (its warmup policies, the only trials a tie can keep) and as many more as run side by
    # side; then the others whose floor (floor.latency_floor: no simulation is faster) is below the best so far,
    # which only falls from there, so a skipped one could not have won (8 x 8: the two of micro-batch 4, 0.38 s each)
    own = sum((b, spans) == chosen[:2] for b, spans, *_ in trials)  # (listed first)
    settle([k for k in range(min(len(trials), max(own, workers))) if k not in took])
    rest = [k for k in range(len(trials)) if k not in took]
    cms: dict = {}  # micro-batch size -> CostModel, as simulate() makes it
    floors: dict = {}  # trial index -> its floor (one at a time, the rest are filtered again after each)

    def floor(k: int) -> float:  # (less 1e-9 of it: its sums run in another order than the simulator's)
        if k not in floors:
            b = trials[k][0]
            if b not in cms:
                cms[b] = CostModel(profile, cluster, b)
            floors[k] = latency_floor(trials[k][-1], cms[b], overlap) * (1 - 1e-9)
        return floors[k]
    while rest:
        below = pick(chosen)[1] * (1 - 1e-3)  # what a trial must simulate below to win
        rest = [k for k in rest if floor(k) < below]
        batch = rest[:1] if workers == 1 else rest  # one at a time in-process: the best falls as they go
        settle(batch)
        rest = rest[len(batch):]
    chosen, best_sim = pick(chosen)
    return chosen, best_sim, len(trials), len(took), used
