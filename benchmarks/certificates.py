"""The plan's certificate against brute force: how often the DP alone, the DP with its seed plans, and dapple.plan
(its search/exact.py enumeration included) reach the model's optimum over every split x device assignment."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dapple  # noqa: E402
from dapple.planner.baselines.exhaustive import exhaustive_search  # noqa: E402
from dapple.planner.search.dp import dp_search  # noqa: E402
from tests.planner.search.test_exact import brute_force_instances  # noqa: E402  (the test's instances)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=11, help="the instances' seed (tests/planner/search/test_exact.py: 11)")
    args = ap.parse_args()
    for model, overlap in (("paper", False), ("refined", True)):
        pol = "A" if model == "paper" else None
        n = alone = seeded = claims = exact = eight = 0
        worst_alone = worst_seeded = 0.0
        t0 = time.perf_counter()
        for prof, c, g, b in brute_force_instances(args.seed):
            best = exhaustive_search(prof, c, g, b, model=model, overlap=overlap, warmup_policy=pol)[0]
            if best == float("inf"):
                continue
            n, eight = n + 1, eight + (c.num_devices == 8)
            kw = dict(model=model, overlap=overlap, warmup_policy=pol)
            d1, d2 = dp_search(prof, c, g, b, seed=False, **kw), dp_search(prof, c, g, b, **kw)
            if d1.latency > best * (1 + 1e-9):
                alone, worst_alone = alone + 1, max(worst_alone, d1.latency / best - 1)
            if d2.latency > best * (1 + 1e-9):
                seeded, worst_seeded = seeded + 1, max(worst_seeded, d2.latency / best - 1)
            p = dapple.plan(prof, c, g, b, verify=0, **kw)
            claims += "this one is the model's best" in str(p)
            exact += abs(p.estimate.latency_ms - best) <= 1e-5 + 1e-9 * best
        print(f"{model}, overlap {overlap}: {n} instances with a plan ({eight} on 2 x 4); the DP alone misses the "
              f"optimum on {alone} (worst {worst_alone:.1%}), with its seed plans on {seeded} (worst "
              f"{worst_seeded:.1%}); dapple.plan(verify=0) returns it on {exact} and prints \"the model's best\" on "
              f"{claims}; {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
