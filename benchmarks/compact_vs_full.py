"""What the compact search (partly used servers kept alike) gives up against the full search (*: stopped at
the time limit)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapple import Cluster, Profile, plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROFILES = Path(os.environ.get("DAPPLE_PIPEDREAM_PROFILES", ROOT / "profiles" / "pipedream"))
# model -> (batch size the profile was taken at, global batch size), as in dapple_vs_pipedream.py
MODELS = {"vgg19": (32, 1024), "resnet50": (128, 2048), "gnmt_16": (64, 1024), "bert_48": (2, 128),
          "bert_large": (2, 128), "xlnet_36": (1, 128), "amoebanet_36": (1, 128)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--servers", default="2,4", help="comma list of server counts of preset A (8 GPUs each)")
    ap.add_argument("--time-limit", type=float, default=None, help="stop each search after this many seconds")
    args = ap.parse_args()
    print("| model | cluster | full: plan, estimate ms, s | compact: plan, estimate ms, s | compact / full estimate |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        batch, g = MODELS[name]
        prof = Profile.from_pipedream(PROFILES / f"{name}.txt", batch)
        for servers in (int(x) for x in args.servers.split(",")):
            cluster = Cluster.preset("A", servers=servers)
            row = []
            for search in ("full", "compact"):
                t = time.perf_counter()
                p = plan(prof, cluster, g, search=search, time_limit=args.time_limit)
                row.append((p.shape, p.estimate.latency_ms, time.perf_counter() - t,
                            "" if p.meta["search_complete"] else "*"))
            (sf, lf, tf, xf), (sc, lc, tc, xc) = row
            print(f"| {name} | {servers}x8 | {sf}, {lf:.1f}, {tf:.2f}{xf} | {sc}, {lc:.1f}, {tc:.2f}{xc} | "
                  f"{lc / lf:.4f} |", flush=True)


if __name__ == "__main__":
    main()
