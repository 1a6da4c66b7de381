"""Error of the latency models (paper formula 2, refined) against the event simulator on random plans."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapple import Cluster, Plan, Profile  # noqa: E402
from dapple.planner import Stage, evaluate, simulate  # noqa: E402
from dapple.profiler import LayerProfile  # noqa: E402

PIPEDREAM = Path(__file__).resolve().parents[1] / "profiles" / "pipedream"
REAL = {"vgg19": 32, "bert_48": 2, "xlnet_36": 1, "amoebanet_36": 1, "gnmt_16": 64, "resnet50": 128}


def synthetic(rng: random.Random, n: int) -> Profile:
    """Layers with varied compute, parameters and activations, profiled at batch 4 and 8 (with intercepts)."""
    layers = []
    for i in range(n):
        f = rng.uniform(0.2, 3.0)
        act = rng.choice([1e4, 1e6, 1e7, 5e7])
        par = rng.choice([0, 1e5, 1e7, 1e8, 4e8])
        layers.append(LayerProfile(f"layer{i}", [f, 1.8 * f], [2 * f, 3.6 * f], [act, 2 * act], [2 * act, 4 * act],
                                   int(par)))
    return Profile("synthetic", "synthetic", [4, 8], layers)


def clusters() -> list[Cluster]:
    return [Cluster.preset("A"), Cluster.preset("B"), Cluster.preset("C"),
            Cluster(4, 4, 50e9, 25e9 / 8, 5e-6, 30e-6, 16e9, name="4x4"),
            Cluster(2, 4, 20e9, 1e9, 5e-6, 50e-6, 16e9, name="2x4 slow")]


def random_plan(rng: random.Random, prof: Profile, cluster: Cluster, shuffle: float = 0.0,
                schedule: str = "dapple") -> Plan | None:
    n, G = prof.num_layers, cluster.num_devices
    S = rng.randint(1, min(6, n, G))
    cuts = sorted(rng.sample(range(1, n), S - 1))
    bounds = [0] + cuts + [n]
    sizes = [1] * S  # devices per stage: a random composition of G
    for _ in range(G - S):
        sizes[rng.randrange(S)] += 1
    order = list(range(G))
    if rng.random() < shuffle:  # devices scattered over servers at random (placements no policy makes)
        rng.shuffle(order)
    devs, k = [], 0
    for s in sizes:
        devs.append(order[k:k + s])
        k += s
    g = rng.choice([64, 128, 256, 512, 1024])
    micro = [b for b in range(max(sizes), g + 1) if g % b == 0 and g // b <= 64]
    if not micro:
        return None
    b = rng.choice(micro)
    try:
        return Plan(g, b, [Stage((bounds[i], bounds[i + 1]), devs[i]) for i in range(S)],
                    warmup_policy=rng.choice("AB"), schedule=schedule)
    except ValueError:
        return None


def score(args: argparse.Namespace, seed: int) -> tuple[dict[str, list[float]], list, list[float]]:
    """Errors of both models on ``args.plans`` random plans drawn with ``seed``: (errors, rows, acr)."""
    rng = random.Random(seed)
    profiles = [Profile.from_pipedream(PIPEDREAM / f"{k}.txt", v) for k, v in REAL.items()
                if (PIPEDREAM / f"{k}.txt").exists()]
    errors: dict[str, list[float]] = {"paper": [], "refined": []}
    rows, acr = [], []
    while len(errors["paper"]) < args.plans:
        prof = rng.choice(profiles) if rng.random() < 0.5 else synthetic(rng, rng.randint(4, 24))
        cluster = rng.choice(clusters())
        cluster.link_sharing = args.link_sharing
        plan = random_plan(rng, prof, cluster, args.shuffle, args.schedule)
        if plan is None:
            continue
        try:
            ests = {m: evaluate(prof, cluster, plan.stages, plan.global_batch_size, plan.micro_batch_size,
                                warmup_policy=plan.warmup_policy, model=m, overlap=args.overlap,
                                schedule=plan.schedule) for m in errors}
        except ValueError:
            continue  # does not fit in memory
        est = {m: e.latency_ms for m, e in ests.items()}
        acr.append(ests["refined"].details["acr"])
        sim = simulate(plan, prof, cluster, overlap=args.overlap, link_sharing=args.judge_link_sharing).latency_ms
        for m in errors:
            errors[m].append((est[m] - sim) / sim)
        rows.append((abs(est["refined"] - sim) / sim, prof.model, cluster.name, plan, est, sim))
    return errors, rows, acr


def p90(errors: list[float]) -> float:
    a = sorted(abs(e) for e in errors)
    return a[int(0.9 * len(a))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--plans", type=int, default=300)
    ap.add_argument("--seed", type=int, nargs="+", default=[0],
                    help="one run per seed (several: each seed's p90, then their median)")
    ap.add_argument("--overlap", action="store_true", help="AllReduce overlapped with the last backward")
    ap.add_argument("--worst", type=int, default=0, help="print the N worst plans of the refined model")
    ap.add_argument("--schedule", default="dapple", choices=("dapple", "gpipe"))
    ap.add_argument("--link-sharing", default="held", choices=("held", "shared"),
                    help="the clusters' Cluster.link_sharing (model and simulator): links held whole by a "
                         "transfer, or shared max-min fairly")
    ap.add_argument("--judge-link-sharing", default=None, choices=("held", "shared"),
                    help="the simulator's only (default: the clusters')")
    ap.add_argument("--shuffle", type=float, default=0.0,
                    help="share of plans whose devices are shuffled (else stages take consecutive devices)")
    args = ap.parse_args()
    p90s = {}
    for seed in args.seed:
        errors, rows, acr = score(args, seed)
        p90s[seed] = {m: p90(es) for m, es in errors.items()}
        print(f"{args.plans} random {args.schedule} plans (seed {seed}, overlap {args.overlap}, shuffled "
              f"{args.shuffle:.0%}): relative error of the model "
              f"against the simulator (link sharing: model {args.link_sharing}, simulator "
              f"{args.judge_link_sharing or args.link_sharing}), (estimate - simulated) / simulated")
        print(f"  {'model':<8} {'median |e|':>10} {'p90 |e|':>9} {'max |e|':>9} {'mean e':>8} {'<=5%':>6}")
        for m, es in errors.items():
            a = sorted(abs(e) for e in es)
            print(f"  {m:<8} {statistics.median(a):>10.2%} {p90(es):>9.2%} {a[-1]:>9.2%} "
                  f"{statistics.mean(es):>8.2%} {sum(x <= 0.05 for x in a) / len(a):>6.0%}")
        for lo, hi in ((0.0, 0.3), (0.3, float("inf"))):
            sel = [i for i, a in enumerate(acr) if lo <= a < hi]
            if sel:
                line = ", ".join(f"{m} median {statistics.median(abs(errors[m][i]) for i in sel):.2%} <=5% "
                                 f"{sum(abs(errors[m][i]) <= 0.05 for i in sel) / len(sel):.0%}" for m in errors)
                print(f"  activation communication ratio in [{lo}, {hi}): {len(sel)} plans: {line}")
        for err, model, cname, plan, est, sim in sorted(rows, key=lambda r: -r[0])[: args.worst]:
            print(f"\n{err:.1%} {model} on {cname}: sim {sim:.2f} paper {est['paper']:.2f} "
                  f"refined {est['refined']:.2f}")
            print(plan)
    if len(args.seed) > 1:
        for m in ("paper", "refined"):
            line = ", ".join(f"seed {s} {v[m]:.2%}" for s, v in p90s.items())
            print(f"p90 abs(e), {m}: {line}; median over seeds {statistics.median(v[m] for v in p90s.values()):.2%}")


if __name__ == "__main__":
    main()
