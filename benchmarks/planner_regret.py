"""What the model's error costs: the simulated latency of dapple.plan's plan against the best plan the simulator finds.

On small instances (synthetic profiles of a few layers, clusters of 4 to 6 devices) every plan is simulated:
every stage split x every assignment of all devices (as server layouts) x every micro-batch size x warmup
policies A and B. The oracle is the fastest of them in the event simulator, the judge of the latency model.
Regret = simulated latency of a plan / the oracle's - 1, for:
- ``plan``: ``dapple.plan`` as users call it (the DP on the refined model, its top candidates simulated);
- ``plan verify=0``: the DP's plan alone, trusting the model;
- ``model's best``: the plan the refined model ranks first among all plans (what a perfect search of the
  model gives).
With ``--schedule auto`` every plan is simulated under dapple's 1F1B and under zb-h1 (where it fits), and
``dapple.plan`` is asked for schedule="auto"; with ``--schedule zb-h1``, zb-h1 alone ("model's best" is left out:
the refined model of zb-h1 is its simulation).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimate_vs_simulator import synthetic  # noqa: E402  (the same random layers as the error benchmark)

import dapple  # noqa: E402
from dapple import Cluster, Plan, Profile  # noqa: E402
from dapple.planner import Stage, evaluate, simulate  # noqa: E402


def clusters() -> list[Cluster]:
    return [Cluster(1, 4, 50e9, 25e9 / 8, 5e-6, 30e-6, 16e9, name="1x4 NVLink"),
            Cluster(2, 2, 50e9, 25e9 / 8, 5e-6, 30e-6, 16e9, name="2x2 25Gbps"),
            Cluster(4, 1, 50e9, 25e9 / 8, 5e-6, 30e-6, 16e9, name="4x1 25Gbps"),
            Cluster(4, 1, 50e9, 10e9 / 8, 5e-6, 30e-6, 16e9, name="4x1 10Gbps"),
            Cluster(2, 3, 50e9, 10e9 / 8, 5e-6, 30e-6, 16e9, name="2x3 10Gbps")]


def layouts(cluster: Cluster, stages: int, max_replicas: int) -> list[tuple[list[int], ...]]:
    """Every way to give ``stages`` stages all devices, one representative device list per server layout (up to
    a relabelling of the servers, which are all alike)."""
    G, seen, out = cluster.num_devices, set(), []
    for order in itertools.permutations(range(G)):
        label: dict[int, int] = {}
        servers = [label.setdefault(cluster.server_of(d), len(label)) for d in order]
        for cuts in itertools.combinations(range(1, G), stages - 1):
            b = (0,) + cuts + (G,)
            if any(b[i + 1] - b[i] > max_replicas for i in range(stages)):
                continue
            key = tuple(tuple(servers[b[i]:b[i + 1]]) for i in range(stages))
            if key not in seen:
                seen.add(key)
                out.append(tuple(list(order[b[i]:b[i + 1]]) for i in range(stages)))
    return out


def every_plan(prof: Profile, cluster: Cluster, g: int, max_m: int, overlap: bool = False):
    """Every plan (all devices used) that fits in memory: (Plan, refined-model latency)."""
    N, G = prof.num_layers, cluster.num_devices
    for b in (b for b in range(1, g + 1) if g % b == 0 and g // b <= max_m):
        for S in range(1, min(N, G) + 1):
            lays = layouts(cluster, S, b)
            for cuts in itertools.combinations(range(1, N), S - 1):
                bounds = (0,) + cuts + (N,)
                for devs in lays:
                    stages = [Stage((bounds[i], bounds[i + 1]), devs[i]) for i in range(S)]
                    for pol in "AB":
                        try:
                            est = evaluate(prof, cluster, stages, g, b, warmup_policy=pol, model="refined",
                                           overlap=overlap)
                        except ValueError:
                            continue  # does not fit in device memory
                        ks = [s["warmup"] for s in est.details["stages"]]
                        yield Plan(g, b, [Stage(s.layers, s.devices, k) for s, k in zip(stages, ks)],
                                   warmup_policy=pol), est.latency_ms


def fits(plan: Plan, prof: Profile, cluster: Cluster) -> bool:
    """Whether a plan fits in device memory under its schedule (zb-h1 holds K_0 micro-batches until their W)."""
    try:
        evaluate(prof, cluster, plan, model="paper")
    except ValueError:
        return False
    return True


def under(cands: list, schedule: str, prof: Profile, cluster: Cluster) -> list:
    """``cands`` (Plan, modelled ms) as the schedules ``schedule`` stands for ("auto": dapple and zb-h1), a
    split-backward one only where it fits."""
    out = []
    for p, est in cands:
        for sch in ("dapple", "zb-h1") if schedule == "auto" else (schedule,):
            q = p if sch == p.schedule else Plan(p.global_batch_size, p.micro_batch_size, p.stages, schedule=sch,
                                                 warmup_policy=p.warmup_policy)
            if q is p or fits(q, prof, cluster):
                out.append((q, est))
    return out


def instance(spec: tuple) -> tuple:
    """One instance: (regret per way of planning, cluster name, global batch, our plan's shape, the oracle's,
    plans simulated)."""
    seed, layers, max_m, link_sharing, overlap, schedule = spec
    rng = random.Random(seed)
    prof = synthetic(rng, rng.randint(*layers))
    cluster = rng.choice(clusters())
    cluster.link_sharing = link_sharing
    g = rng.choice([32, 64, 128])
    sizes = [b for b in range(1, g + 1) if g % b == 0 and g // b <= max_m]
    cands = under(list(every_plan(prof, cluster, g, max_m, overlap)), schedule, prof, cluster)
    if not cands:
        return None
    sims = [simulate(p, prof, cluster, overlap=overlap).latency_ms for p, _ in cands]
    oracle = min(sims)
    model_best = min(range(len(cands)), key=lambda i: cands[i][1])
    ours = {"plan": dapple.plan(prof, cluster, g, micro_batch_sizes=sizes, overlap=overlap, schedule=schedule),
            "plan verify=0": dapple.plan(prof, cluster, g, micro_batch_sizes=sizes, verify=0, overlap=overlap,
                                         schedule=schedule)}
    got = {k: simulate(p, prof, cluster, overlap=overlap).latency_ms for k, p in ours.items()}
    if schedule == "dapple":
        got["model's best"] = sims[model_best]
    best = cands[min(range(len(sims)), key=sims.__getitem__)][0]
    mine = ours["plan"]
    return ({k: t / oracle - 1 for k, t in got.items()}, cluster.name, g, f"{mine.shape} {mine.schedule}",
            mine.micro_batch_size, f"{best.shape} {best.schedule}", best.micro_batch_size, len(cands))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, nargs=2, default=(4, 6), help="layers per profile: a range")
    ap.add_argument("--max-micro-batches", type=int, default=32, help="micro-batch sizes with M above this are skipped")
    ap.add_argument("--link-sharing", default="held", choices=("held", "shared"))
    ap.add_argument("--overlap", action="store_true", help="AllReduce overlapped: model, planner and simulator")
    ap.add_argument("--schedule", default="dapple", choices=("dapple", "auto", "zb-h1"),
                    help="the schedules every plan is simulated under and dapple.plan is asked for")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    t0 = time.perf_counter()
    specs = [(args.seed * 100_003 + i, tuple(args.layers), args.max_micro_batches, args.link_sharing,
              args.overlap, args.schedule) for i in range(args.instances)]
    with multiprocessing.Pool(args.workers) as pool:
        results = [r for r in pool.map(instance, specs) if r is not None]
    regrets: dict[str, list[float]] = {k: [r[0][k] for r in results] for k in results[0][0]}
    print(f"{len(results)} instances (seed {args.seed}, {args.layers[0]}-{args.layers[1]} layers, link sharing "
          f"{args.link_sharing}{', overlap' if args.overlap else ''}, schedule {args.schedule}): "
          f"{sum(r[-1] for r in results)} plans "
          f"simulated in {time.perf_counter() - t0:.0f} s")
    print("  regret = simulated latency / the best simulated plan's - 1")
    print(f"  {'plan':<14} {'optimal':>8} {'median':>8} {'p90':>7} {'max':>7} {'<=1%':>6} {'<=5%':>6}")
    for k, rs in regrets.items():
        a = sorted(rs)
        print(f"  {k:<14} {sum(r <= 1e-9 for r in a) / len(a):>8.0%} {statistics.median(a):>8.2%} "
              f"{a[int(0.9 * len(a))]:>7.2%} {a[-1]:>7.2%} {sum(r <= 0.01 for r in a) / len(a):>6.0%} "
              f"{sum(r <= 0.05 for r in a) / len(a):>6.0%}")
    print("  worst for dapple.plan:")
    for r in sorted(results, key=lambda r: -r[0]["plan"])[:5]:
        print(f"    {r[0]['plan']:+.2%} on {r[1]}, global {r[2]}: plan {r[3]} x{r[4]}, best {r[5]} x{r[6]}")


if __name__ == "__main__":
    main()
