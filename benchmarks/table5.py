"""DAPPLE's plans for the paper's models on configs A, B, C (paper Table V / VII), scored by the simulator."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapple import Cluster, Profile, plan, simulate  # noqa: E402

PIPEDREAM = Path(__file__).resolve().parents[1] / "profiles" / "pipedream"
MODELS = {  # profile batch size, global batch sizes of Table V / VII
    "vgg19": (32, [1024, 2048]), "resnet50": (128, [2048]), "gnmt_16": (64, [1024]), "bert_48": (2, [64, 128]),
    "bert_large": (2, [128]), "xlnet_36": (1, [128]), "amoebanet_36": (1, [128])}
TABLE_MODELS = "vgg19,resnet50,gnmt_16,bert_48,xlnet_36,amoebanet_36"  # Table V's (bert_large: Table VII's)
PAPER_MODE = dict(model="paper", overlap=False)  # the paper's planner: formula 2, no AllReduce overlap
TABLE_V = {  # (model, global batch) -> the paper's plans on A, B, C (Table V)
    ("resnet50", 2048): ("DP", "DP", "DP"), ("vgg19", 2048): ("DP", "DP", "15:1"),
    ("gnmt_16", 1024): ("8:8", "8:8", "straight"), ("bert_48", 64): ("8:8", "straight", "straight"),
    ("xlnet_36", 128): ("8:8", "8:8", "straight"), ("amoebanet_36", 128): ("8:8", "11:5", "11:5")}


def cases(args: argparse.Namespace):
    """(model name, global batch, config, Profile, Cluster) of every case the arguments select."""
    for name in args.models.split(","):
        pb, gbs_list = MODELS[name]
        prof = Profile.from_pipedream(PIPEDREAM / f"{name}.txt", pb)
        for gbs in gbs_list:
            for cfg in args.configs.split(","):
                yield name, gbs, cfg, prof, Cluster.preset(cfg)


def compare_overlap(args: argparse.Namespace) -> None:
    """Plans made without and with ``overlap``, both played by the simulator with the AllReduce overlapped (as
    dapple's runtime runs them), next to Table V's plan."""
    print(f"{'model':<13} {'GBS':>5} {'cfg':>3} {'Table V':>8}  {'plan, no overlap':<22} {'plan, overlap':<22} "
          f"{'sim ms':>8} {'sim ms':>8} {'ratio':>6} {'plan s':>6}")
    for name, gbs, cfg, prof, cluster in cases(args):
        row, sims, dt = [], [], 0.0
        for overlap in (False, True):
            t = time.perf_counter()
            p = plan(prof, cluster, gbs, model=args.model, overlap=overlap, time_limit=args.time_limit)
            dt = time.perf_counter() - t
            sims.append(simulate(p, prof, cluster, overlap=True).latency_ms)
            row.append(f"{p.shape} b{p.micro_batch_size}" + ("" if p.meta["search_complete"] else "*"))
        paper = TABLE_V.get((name, gbs), ("-",) * 3)["ABC".index(cfg)] if cfg in "ABC" else "-"
        print(f"{name:<13} {gbs:>5} {cfg:>3} {paper:>8}  {row[0]:<22} {row[1]:<22} {sims[0]:8.1f} "
              f"{sims[1]:8.1f} {sims[0] / sims[1]:6.3f} {dt:6.2f}", flush=True)


def compare_paper(args: argparse.Namespace) -> None:
    """dapple.plan's default (refined model, AllReduce overlapped as the runtime runs it) against the paper's planner
    (``model="paper", overlap=False``), both plans simulated overlapped (as dapple's runtime runs them)."""
    print(f"{'model':<13} {'GBS':>5} {'cfg':>3} {'Table V':>8}  {'default plan':<24} {'paper-mode plan':<24} "
          f"{'sim ms':>8} {'sim ms':>8} {'paper/default':>13} {'plan s':>6} {'plan s':>6}")
    for name, gbs, cfg, prof, cluster in cases(args):
        row, sims, secs = [], [], []
        for kw in (dict(), PAPER_MODE):
            t = time.perf_counter()
            p = plan(prof, cluster, gbs, time_limit=args.time_limit, **kw)
            secs.append(time.perf_counter() - t)
            sims.append(simulate(p, prof, cluster, overlap=True).latency_ms)
            row.append(f"{p.shape} b{p.micro_batch_size}" + ("" if p.meta["search_complete"] else "*"))
        paper = TABLE_V.get((name, gbs), ("-",) * 3)["ABC".index(cfg)] if cfg in "ABC" else "-"
        print(f"{name:<13} {gbs:>5} {cfg:>3} {paper:>8}  {row[0]:<24} {row[1]:<24} {sims[0]:8.1f} "
              f"{sims[1]:8.1f} {sims[1] / sims[0]:13.3f} {secs[0]:6.2f} {secs[1]:6.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default=TABLE_MODELS, help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--configs", default="A,B,C")
    ap.add_argument("--model", default="refined", choices=("refined", "paper"))
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False,
                    help="plan and simulate with AllReduce overlapped (dapple.plan's default; off here: the paper's "
                         "assumption)")
    ap.add_argument("--compare-overlap", action="store_true",
                    help="plan without and with overlap; simulate both overlapped (the runtime overlaps)")
    ap.add_argument("--compare-paper", action="store_true",
                    help="dapple.plan's default plan against the paper mode's (model='paper', overlap=False), both "
                         "simulated overlapped")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per plan (anytime search)")
    ap.add_argument("--micro-batch", default="searched",
                    help="'searched' (divisors of the global batch) or 'profiled' (the profile's batch size)")
    args = ap.parse_args()
    if args.compare_overlap:
        compare_overlap(args)
        return
    if args.compare_paper:
        compare_paper(args)
        return
    print(f"{'model':<13} {'GBS':>5} {'cfg':>3}  {'plan':<14} {'split':<22} {'micro':>5} {'pol':>3} "
          f"{'est ms':>9} {'sim ms':>9} {'DP sim ms':>9} {'plan s':>6}")
    for name, gbs, cfg, prof, cluster in cases(args):
        pb = MODELS[name][0]
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
