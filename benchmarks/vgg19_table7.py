"""VGG-19 on preset A at global batch 1024: our plan against the paper's 14:2 (Table VII), same simulator."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapple import Cluster, Plan, Profile, evaluate, plan, simulate  # noqa: E402
from dapple.planner import Stage  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROFILES = Path(os.environ.get("DAPPLE_PIPEDREAM_PROFILES", ROOT / "profiles" / "pipedream"))
GBS = 1024
# Table VII prints (0, 16) @ [G0 - G13], (17, 25) @ [G14, G15]: inclusive ranges, so the cut is after layer 16
# (node17, the 4th max-pool) and the 2-device stage starts at conv5_1.
PAPER_CUT = 17


def best_of(prof: Profile, cluster: Cluster, cut: int, overlap: bool) -> tuple[float, Plan]:
    """The fastest 14:2 with the cut after layer ``cut`` - 1, over micro-batch sizes and warmup policies A, B
    (simulated; each 14-replica slice needs a row, so micro-batches of at least 14)."""
    best = (float("inf"), None)
    for b in (16, 32, 64, 128, 256, 512, 1024):
        for policy in ("A", "B"):
            p = Plan(GBS, b, [Stage((0, cut), list(range(14))), Stage((cut, prof.num_layers), [14, 15])],
                     warmup_policy=policy)
            try:
                p.estimate = evaluate(prof, cluster, p, model="refined", overlap=overlap)
            except ValueError:  # out of device memory at this micro-batch
                continue
            best = min(best, (simulate(p, prof, cluster, overlap=overlap).latency_ms, p), key=lambda t: t[0])
    return best


def work_ms(prof: Profile) -> list[float]:
    """Each layer's forward + backward ms at the batch size the profile was taken at."""
    c = prof.costs(prof.batch_sizes[0])
    return [f + b for f, b in zip(c.forward_ms, c.backward_ms)]


def stage_line(p: Plan, work: list[float]) -> str:
    """Replicas, layers, the work per replica (a balanced plan gives every stage about the same) and the
    modelled AllReduce of each stage."""
    return "; ".join(f"{len(s.devices)}x[{s.layers[0]},{s.layers[1]}) work/replica "
                     f"{sum(work[s.layers[0]:s.layers[1]]) / len(s.devices):.1f} ms, AR {d['allreduce_ms']:.1f} ms"
                     for s, d in zip(p.stages, p.estimate.details["stages"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--inter-gbps", type=float, nargs="+", default=[25.0, 50.0, 100.0, 200.0],
                    help="inter-server bandwidths to plan for (Gbit/s; the paper's config A: 25)")
    ap.add_argument("--overlap", action="store_true", help="AllReduce overlaps the last backward (plan and simulator)")
    ap.add_argument("--tail-scale", type=float, default=1.0,
                    help="multiply the forward and backward times of the paper's 2-device stage (conv5_1 to the "
                         "loss) by this: 1.43 gives it about 1/8 of the work (12.7%%), the share of devices 14:2 "
                         "gives it")
    args = ap.parse_args()
    prof = Profile.from_pipedream(PROFILES / "vgg19.txt", 32)
    if args.tail_scale != 1.0:
        prof = dataclasses.replace(prof, layers=[
            dataclasses.replace(lay, forward_ms=[t * args.tail_scale for t in lay.forward_ms],
                                backward_ms=[t * args.tail_scale for t in lay.backward_ms]) if i >= PAPER_CUT else lay
            for i, lay in enumerate(prof.layers)])
    work = work_ms(prof)
    print(f"vgg19 (PipeDream's profile at batch 32{f', tail x {args.tail_scale:g}' if args.tail_scale != 1 else ''}), "
          f"global batch {GBS}, preset A with the inter-server link varied; overlap {args.overlap}; every plan scored "
          f"by dapple.simulate. Layers [{PAPER_CUT}, {prof.num_layers}) hold "
          f"{sum(work[PAPER_CUT:]) / sum(work):.1%} of the work; 14:2 gives them 2/16 = 12.5% of the devices")
    for gbps in args.inter_gbps:
        cluster = dataclasses.replace(Cluster.preset("A"), inter_bandwidth=gbps * 1e9 / 8)
        ours = plan(prof, cluster, GBS, overlap=args.overlap)
        t_ours = simulate(ours, prof, cluster, overlap=args.overlap).latency_ms
        cuts = {cut: best_of(prof, cluster, cut, args.overlap) for cut in range(12, prof.num_layers - 3)}
        t_paper, paper = cuts[PAPER_CUT]
        best_cut = min(cuts, key=lambda cut: cuts[cut][0])
        print(f"\ninter {gbps:g} Gbit/s: ours {ours.shape} b{ours.micro_batch_size} {ours.warmup_policy} "
              f"{t_ours:.1f} ms simulated | paper's 14:2 (cut {PAPER_CUT}) b{paper.micro_batch_size} "
              f"{paper.warmup_policy} {t_paper:.1f} ms = {t_paper / t_ours:.3f}x ours | best 14:2 cut {best_cut} "
              f"{cuts[best_cut][0]:.1f} ms = {cuts[best_cut][0] / t_ours:.3f}x ours")
        print(f"  ours : {stage_line(ours, work)}")
        print(f"  paper: {stage_line(paper, work)}")


if __name__ == "__main__":
    main()
