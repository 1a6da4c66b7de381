"""Simulated gain of dapple.plan's plan of two chunks per device group, with a replicated chunk, over one stage per
rank (the straight pipeline), on a model whose layers differ (compute-heavy layers with few parameters, then light
layers with many: DAPPLE's case for uneven replication).

The straight pipeline is the best of every cut of the layers into one stage per device, each simulated under dapple's
1F1B and zb-h1; the search's own plan (one stage per device group, its schedule settled by the simulator) and the
plan ``dapple.plan(..., schedule="auto")`` returns (two chunks per group where they simulate faster) are beside it.
Pure planner: no processes.

    PYTHONPATH=$PWD python benchmarks/replicated_chunks.py [--devices 6 --heavy 8 --light 4 --global-batch 48]
"""

from __future__ import annotations

import argparse
import itertools

import dapple
from dapple.planner import Stage, simulate
from dapple.profiler import LayerProfile


def profile(heavy: int, light: int, batch: int = 8) -> dapple.Profile:
    """``heavy`` layers of 3 ms per row forward and 1 MB of parameters, then ``light`` layers of 0.5 ms and 400 MB
    (a conv trunk, then fully connected layers); backward twice the forward; 64 KB per row crosses each cut."""
    layers = []
    for i in range(heavy + light):
        f, params = (3.0, 1e6) if i < heavy else (0.5, 4e8)
        layers.append(LayerProfile(f"layer{i}", [f * batch], [2 * f * batch], [65536.0 * batch], [1e5 * batch],
                                   int(params)))
    return dapple.Profile("trunk+head", "synthetic", [batch], layers)


def straight(prof: dapple.Profile, cluster: dapple.Cluster, g: int, b: int) -> tuple[float, dapple.Plan]:
    """The fastest straight pipeline (one stage per device) over every cut and both one-stage schedules."""
    n, d = prof.num_layers, cluster.num_devices
    best = (float("inf"), None)
    for cuts in itertools.combinations(range(1, n), d - 1):
        ends = [0, *cuts, n]
        for schedule in ("dapple", "zb-h1"):
            p = dapple.Plan(g, b, [Stage((ends[i], ends[i + 1]), [i]) for i in range(d)], schedule=schedule)
            best = min(best, (simulate(p, prof, cluster).latency_ms, p), key=lambda x: x[0])
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=6)
    ap.add_argument("--heavy", type=int, default=8)
    ap.add_argument("--light", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=48)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--bandwidth", type=float, default=1e10, help="bytes/s between devices (one server)")
    args = ap.parse_args()
    prof = profile(args.heavy, args.light, args.micro_batch)
    cluster = dapple.Cluster(1, args.devices, args.bandwidth, args.bandwidth, 5e-6, 5e-6, 1e12, name="one server")
    g, b = args.global_batch, args.micro_batch
    base_ms, base = straight(prof, cluster, g, b)
    p = dapple.plan(prof, cluster, g, b, schedule="auto", workers=1)
    choice = p.meta["schedule_choice"]
    chunked_ms = simulate(p, prof, cluster).latency_ms
    print(f"{prof.num_layers} layers ({args.heavy} heavy, {args.light} light), {args.devices} devices, "
          f"M = {g // b} micro-batches of {b}")
    print(f"one stage per rank (best cut, {base.schedule}): {base_ms:.2f} ms  "
          f"{[s.layers for s in base.stages]}")
    own = choice.get("simulated_ms", {})
    print("the search's plan, one stage per device group: " + ", ".join(f"{k} {v:.2f} ms" for k, v in own.items()))
    for t in choice.get("chunked", []):
        print(f"  two chunks, {t['schedule']} on {t['layout']}: "
              + (f"{t['simulated_ms']:.2f} ms" if "simulated_ms" in t else f"not tried: {t['refused']}")
              + (f" ({t['moves']} cut moves)" if "moves" in t else ""))
    print(f"dapple.plan(schedule='auto'): {p.schedule}, "
          f"{[(s.layers, s.devices) for s in p.stages]}, {chunked_ms:.2f} ms")
    v = dapple.plan(prof, cluster, g, b, schedule="zb-v", workers=1)  # by name: its fastest variant, cuts moved
    moves = [t.get("moves") for t in v.meta["schedule_choice"]["chunked"] if "moves" in t]
    print(f"dapple.plan(schedule='zb-v'): {simulate(v, prof, cluster).latency_ms:.2f} ms ({moves[0]} cut moves), "
          f"{[(s.layers, s.devices) for s in v.stages]}")
    replicated = p.chunks.chunks > 1 and any(s.replicas > 1 for s in p.stages)
    print(f"replicated chunk: {'yes' if replicated else 'no'}; simulated gain over one stage per rank: "
          f"{base_ms / chunked_ms:.3f}x" + (f", over the search's plan: {min(own.values()) / chunked_ms:.3f}x"
                                            if own else ""))


if __name__ == "__main__":
    main()
