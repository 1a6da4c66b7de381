"""DAPPLE's plans for the paper's models on configs A, B, C (paper Table V / VII), scored by the simulator."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapple import Cluster, Profile, plan, simulate  # noqa: E402

PIPEDREAM = Path(__file__).resolve().parents[2] / "shared" / "profiles" / "pipedream"
MODELS = {  # profile batch size, global batch sizes of Table V / VII
    "vgg19": (32, [1024, 2048]), "resnet50": (128, [2048]), "gnmt_16": (64, [1024]), "bert_48": (2, [64, 128]),
    "xlnet_36": (1, [128]), "amoebanet_36": (1, [128])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--configs", default="A,B,C")
    ap.add_argument("--model", default="refined", choices=("refined", "paper"))
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per plan (anytime search)")
    ap.add_argument("--micro-batch", default="searched",
                    help="'searched' (divisors of the global batch) or 'profiled' (the profile's batch size)")
    args = ap.parse_args()
    print(f"{'model':<13} {'GBS':>5} {'cfg':>3}  {'plan':<14} {'split':<22} {'micro':>5} {'pol':>3} "
          f"{'est ms':>9} {'sim ms':>9} {'DP sim ms':>9} {'plan s':>6}")
    for name in args.models.split(","):
        pb, gbs_list = MODELS[name]
        prof = Profile.from_pipedream(PIPEDREAM / f"{name}.txt", pb)
        for gbs in gbs_list:
            for cfg in args.configs.split(","):
                cluster = Cluster.preset(cfg)
                micro = pb if args.micro_batch == "profiled" and gbs % pb == 0 and pb >= 16 else None
                t = time.perf_counter()
                try:
                    p = plan(prof, cluster, gbs, micro, model=args.model, overlap=args.overlap,
                             time_limit=args.time_limit)
                except ValueError as e:
                    print(f"{name:<13} {gbs:>5} {cfg:>3}  no plan: {e}")
                    continue
                dt = time.perf_counter() - t
                sim = simulate(p, prof, cluster, overlap=args.overlap).latency_ms
                try:  # pure data parallelism at the same micro-batch size, for reference
                    dp = plan(prof, cluster, gbs, model=args.model, overlap=args.overlap, max_stages=1)
                    dps = f"{simulate(dp, prof, cluster, overlap=args.overlap).latency_ms:9.1f}"
                except ValueError:
                    dps = f"{'OOM':>9}"
                split = " | ".join(f"{s.layers[0]}-{s.layers[1]}" for s in p.stages) if p.num_stages <= 3 else "..."
                print(f"{name:<13} {gbs:>5} {cfg:>3}  {p.shape:<14} {split:<22} {p.micro_batch_size:>5} "
                      f"{p.warmup_policy:>3} {p.estimate.latency_ms:9.1f} {sim:9.1f} {dps} {dt:6.2f}"
                      + ("" if p.meta["search_complete"] else " (time limit)"), flush=True)


if __name__ == "__main__":
    main()
