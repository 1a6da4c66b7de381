"""Planning time of dapple.plan: bert_48 on 2x8 (paper config A), a 128-layer model on 8x8 and on 128x8."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapple import Cluster, Plan, Profile, plan  # noqa: E402
from dapple.profiler import LayerProfile  # noqa: E402

PIPEDREAM = Path(__file__).resolve().parents[1] / "profiles" / "pipedream"


def synthetic(n: int, seed: int = 0, out_bytes: float = 4e6) -> Profile:
    """A transformer-like stack: n layers of varied compute (+-30%), 50 MB of parameters and 4 MB of activations
    per row each (``out_bytes`` of output: what crosses a stage boundary), profiled at batch 1 and 8 (a fixed
    per-layer overhead)."""
    rng = random.Random(seed)
    layers = []
    for i in range(n):
        f = rng.uniform(0.7, 1.3)
        layers.append(LayerProfile(f"block{i}", [0.2 + f, 0.2 + 8 * f], [0.4 + 2 * f, 0.4 + 16 * f],
                                   [out_bytes, 8 * out_bytes], [16e6, 128e6], int(50e6)))
    return Profile(f"synthetic{n}", "synthetic", [1, 8], layers)


def compute_chains(p: Plan) -> float:
    """The most, over the plan's stages s, of its compute and AllReduce alone, the terms the search's lower bound
    keeps: the first micro-batch's forwards before s + M (F_s + B_s) + what s's overlapped AllReduce adds after
    its last backward (transfers, warmup round trips and link queues left out)."""
    st, M = p.estimate.details["stages"], p.num_micro_batches
    out = 0.0
    for i, d in enumerate(st):
        tail = max(d.get("overlapped_ending_ms", d["allreduce_ms"] + d["backward_ms"]) - d["backward_ms"], 0.0)
        out = max(out, sum(x["forward_ms"] for x in st[:i]) + M * (d["forward_ms"] + d["backward_ms"]) + tail)
    return out


def timed(repeats: int, fn):
    times, result = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), times, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--big", action="store_true", help="also plan the 128-layer model on 128 x 8 = 1024 devices")
    ap.add_argument("--big-only", action="store_true", help="only the 128 x 8 cases (with --big)")
    ap.add_argument("--free-activations", action="store_true",
                    help="layers whose outputs are 1 byte a row: stage boundaries cost (almost) no transfer time")
    ap.add_argument("--model", default="refined", choices=("refined", "paper"))
    ap.add_argument("--schedule", default="dapple", choices=("dapple", "zb-h1", "auto"),
                    help="plan(schedule=...): auto and zb-h1 have the simulator judge the candidates under them")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="stop the 8x8 and 128x8 searches after this many seconds (anytime: best plan so far)")
    ap.add_argument("--gap", type=float, default=0.01,
                    help="the optimality gap of the 8x8 cases marked 'gap' (plan(gap=...)); 0 leaves them out")
    ap.add_argument("--workers", default="auto",
                    help="plan(workers=...): processes searching micro-batch sizes side by side (auto: one per core "
                         "for the compact search)")
    args = ap.parse_args()
    workers = args.workers if args.workers == "auto" else int(args.workers)
    bert = lambda: Profile.from_pipedream(PIPEDREAM / "bert_48.txt", 2)  # noqa: E731
    eight = lambda: Cluster.preset("A", servers=8)  # noqa: E731
    cases = [("bert_48, global 64, 2x8 (A), micro-batch searched", bert, lambda: Cluster.preset("A"), 64, None, None,
              0.0),
             ("bert_48, global 64, 2x8 (A), micro-batch 8", bert, lambda: Cluster.preset("A"), 64, 8, None, 0.0),
             ("synthetic 128 layers, global 512, 8x8, micro-batch 8",
              lambda: synthetic(128), eight, 512, 8, args.time_limit, 0.0),
             ("synthetic 128 layers, global 512, 8x8, micro-batch searched",
              lambda: synthetic(128), eight, 512, None, args.time_limit, 0.0)]
    if args.gap:
        cases += [(f"synthetic 128 layers, global 512, 8x8, micro-batch 8, gap {args.gap:.1%}",
                   lambda: synthetic(128), eight, 512, 8, args.time_limit, args.gap),
                  (f"synthetic 128 layers, global 512, 8x8, micro-batch searched, gap {args.gap:.1%}",
                   lambda: synthetic(128), eight, 512, None, args.time_limit, args.gap)]
    if args.big:
        big = lambda: Cluster.preset("A", servers=128)  # noqa: E731
        layers = lambda: synthetic(128, out_bytes=1.0 if args.free_activations else 4e6)  # noqa: E731
        cases = cases[:0] if args.big_only else cases
        cases += [("synthetic 128 layers, global 8192, 128x8 (1024 devices), micro-batch 64",
                   layers, big, 8192, 64, args.time_limit, 0.0),
                  ("synthetic 128 layers, global 8192, 128x8 (1024 devices), micro-batch searched",
                   layers, big, 8192, None, args.time_limit, 0.0)]
    for name, prof, cluster, g, b, limit, gap in cases:
        p, c = prof(), cluster()
        med, times, result = timed(args.repeats, lambda: plan(p, c, g, b, model=args.model, time_limit=limit,
                                                              gap=gap, workers=workers, schedule=args.schedule))
        print(f"{name}: median {med:.3f} s over {len(times)} runs ({', '.join(f'{t:.3f}' for t in times)}); "
              f"{result.num_stages} stages {[len(s.devices) for s in result.stages]}, micro-batch "
              f"{result.micro_batch_size}, {result.meta['dp_states']} DP states, "
              f"{result.meta['dp_transitions']} transitions, estimate {result.estimate.latency_ms:.1f} ms, "
              f"search {'complete' if result.meta['search_complete'] else 'stopped at the time limit'}, "
              f"{result.meta['workers']} worker(s), schedule {result.schedule}"
              + (f" (no plan below {result.meta['latency_lower_bound_ms']:.1f} ms: at most "
                 f"{result.estimate.latency_ms / result.meta['latency_lower_bound_ms'] - 1:.1%} off the optimum)"
                 if "latency_lower_bound_ms" in result.meta else "")
              + f"; its stages' compute and AllReduce alone: {compute_chains(result):.1f} ms", flush=True)


if __name__ == "__main__":
    main()
