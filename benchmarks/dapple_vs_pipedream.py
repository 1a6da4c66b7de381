"""DAPPLE's planner vs PipeDream's (paper Table VII / Fig. 13): both plans scored by the same event simulator."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapple import Cluster, Profile, plan, simulate  # noqa: E402
from dapple.planner import pipedream_plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROFILES = Path(os.environ.get("DAPPLE_PIPEDREAM_PROFILES", ROOT / "profiles" / "pipedream"))
# model -> (batch size the profile was taken at (tests/conftest.py PIPEDREAM_MODELS), global batch size: Table VII
# for the four models the paper compares with PipeDream, Table V otherwise)
MODELS = {"vgg19": (32, 1024), "resnet50": (128, 2048), "gnmt_16": (64, 1024), "bert_48": (2, 128),
          "bert_large": (2, 128), "xlnet_36": (1, 128), "amoebanet_36": (1, 128)}
# paper Table VII (2x8, config A), in the paper's (start, end) @ GPUs notation; Fig. 13: "up to 3.23x"
PAPER = {"vgg19": ("14:2", "8:6:1:1"), "bert_large": ("8:8", "2:6:2:2:2:2"), "xlnet_36": ("8:8", "straight"),
         "amoebanet_36": ("8:8", "straight")}  # (DAPPLE, PipeDream) as replicas per stage


def cluster_of(name: str) -> Cluster:
    """'A' (2x8), 'A4' (4x8, Fig. 13's second cluster), 'B', 'C' (16x1)."""
    return Cluster.preset("A", servers=4) if name == "A4" else Cluster.preset(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--configs", default="A", help="comma list of A, A4 (4x8), B, C")
    ap.add_argument("--overlap", action="store_true", help="AllReduce overlaps the last backward (both plans)")
    ap.add_argument("--pipedream-intra", type=float, default=None,
                    help="intra-server bandwidth PipeDream plans with (B/s; default: the cluster's). 5e10 is the "
                         "paper's PipeDream command line (-b 5e10 3.125e9, benchmarks/pipedream_table6.py)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per DAPPLE plan (anytime search)")
    args = ap.parse_args()
    print(f"{'model':<13} {'GBS':>5} {'cfg':>3}  {'DAPPLE':<12} {'PipeDream':<22} {'DP ms':>8} {'DAPPLE ms':>9} "
          f"{'PD ms':>9} {'DAPPLE/DP':>9} {'PD/DP':>6} {'speedup':>7} {'plan s':>6}  paper (A: DAPPLE | PD)")
    for cfg in args.configs.split(","):
        cluster = cluster_of(cfg)
        for name in args.models.split(","):
            pb, gbs = MODELS[name]
            prof = Profile.from_pipedream(PROFILES / f"{name}.txt", pb)
            t = time.perf_counter()
            ours = plan(prof, cluster, gbs, overlap=args.overlap, time_limit=args.time_limit)
            dt = time.perf_counter() - t
            t_ours = simulate(ours, prof, cluster, overlap=args.overlap).latency_ms
            try:
                levels = None if args.pipedream_intra is None else [
                    (cluster.devices_per_server, args.pipedream_intra), (cluster.servers, cluster.inter_bandwidth)]
                pd = pipedream_plan(prof, cluster, gbs, levels=levels)
            except ValueError as e:  # gnmt_16: > 512 antichain states; PipeDream's DP is cubic in them
                print(f"{name:<13} {gbs:>5} {cfg:>3}  {ours.shape:<12} PipeDream: {str(e)[15:95]}...", flush=True)
                continue
            t_pd = simulate(pd, prof, cluster, overlap=args.overlap).latency_ms
            try:  # pure data parallelism (the paper's speedup baseline), its micro-batch size searched too
                dp = plan(prof, cluster, gbs, overlap=args.overlap, max_stages=1)
                t_dp = simulate(dp, prof, cluster, overlap=args.overlap).latency_ms
            except ValueError:  # the whole model does not fit on one device
                t_dp = float("nan")
            pd_desc = pd.shape + f" b{pd.micro_batch_size}"
            flag = "" if ours.meta["search_complete"] else "*"
            print(f"{name:<13} {gbs:>5} {cfg:>3}  {ours.shape + flag:<12} {pd_desc:<22} {t_dp:8.1f} "
                  f"{t_ours:9.1f} {t_pd:9.1f} {t_dp / t_ours:9.2f} {t_dp / t_pd:6.2f} {t_pd / t_ours:6.2f}x "
                  f"{dt:6.1f}  {' | '.join(PAPER.get(name, ('-', '-')))}", flush=True)
    print("speedup = PipeDream's simulated iteration time / DAPPLE's (same simulator, same cluster, same profile);"
          " DAPPLE/DP and PD/DP: speedups over pure data parallelism (Fig. 13's axis); * = search stopped at the"
          " time limit (best plan so far)")
    print("paper: Table VII plans on 2x8 (config A); Fig. 13: DAPPLE's plans beat PipeDream's by up to 3.23x "
          "(speedups over DP, 2x8 and 4x8)")


if __name__ == "__main__":
    main()
