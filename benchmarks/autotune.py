"""The Autotuner on 4 local ranks: step time before, during and after a slowdown, against the plan made from the
true costs.

Eight emulated-accelerator layers (each holds its rank 1.5 to 4 ms per row forward, twice that backward, after a
512-wide Linear: 1 MB of parameters each) and a head are profiled with ``dapple.profile`` and planned with
``dapple.plan`` for ``Cluster.local(4)`` (links and AllReduce measured with gloo) with ``--memory`` MB per device,
so that no device holds the whole model and plans are pipelines. Training runs with AdamW and
``dapple.Autotuner(every=--every, margin=--margin)``; after ``--slow-at`` steps the layers of the first
plan's longest stage slow down ``--factor`` x, wherever they run (their ``slowdown`` buffers). The plan made from the
true costs is ``dapple.plan`` on the profile with those layers' times multiplied by the factor; it runs after the
tuned run in the same processes, slowed down alike. Step = ``train_step`` on rank 0 (the loss AllReduce ends it on
every rank together); phases: "before" the slowdown, "during" (from the slowdown to the end of the second window
after it), "after" (the rest).

    PYTHONPATH=$PWD python benchmarks/autotune.py --json run1.json     # ~2 minutes
    PYTHONPATH=$PWD python benchmarks/autotune.py --aggregate run1.json run2.json run3.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import dapple
from dapple.models import EmulatedNet

WORLD = 4
MS_PER_ROW = [1.5, 4.0, 2.0, 3.0, 1.5, 4.0, 2.5, 2.0]
WIDTH, CLASSES = 512, 4


def make_model() -> EmulatedNet:
    torch.manual_seed(0)
    return EmulatedNet(MS_PER_ROW, width=WIDTH, num_classes=CLASSES)


def batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, WIDTH, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def slowed_layers(plan: dapple.Plan) -> list[int]:
    """The emulated layers of the plan's stage with the most of them (the first such stage)."""
    spans = [range(s.layers[0], min(s.layers[1], len(MS_PER_ROW))) for s in plan.stages]
    return list(max(spans, key=lambda r: sum(MS_PER_ROW[i] for i in r) / len(plan.stages[spans.index(r)].devices)))


def true_profile(prof: dapple.Profile, layers: list[int], factor: float) -> dapple.Profile:
    """``prof`` with ``layers`` taking ``factor`` x their profiled times."""
    out = dapple.Profile.from_dict(prof.to_dict())
    for i in layers:
        lay = out.layers[i]
        lay.forward_ms = [v * factor for v in lay.forward_ms]
        lay.backward_ms = [v * factor for v in lay.backward_ms]
        if lay.weight_ms is not None:
            lay.weight_ms = [v * factor for v in lay.weight_ms]
    return out


def slow_down(pipe: dapple.Pipeline, layers: list[int], factor: float) -> None:
    """Slow the emulated ``layers`` this rank runs down ``factor`` x: their ``slowdown`` buffers in its stage (a
    switch of plan moves them with the layers; the stage shares no module with the model once it has switched)."""
    wanted = {f"layers.{i}.slowdown" for i in layers}
    for name, buf in pipe.module.named_buffers():
        if name in wanted:
            buf.fill_(factor)


def _step_ms(pipe: dapple.Pipeline, x, y, opt) -> float:
    t0 = time.perf_counter()
    pipe.train_step(x, y)
    ms = (time.perf_counter() - t0) * 1e3
    opt.step()
    opt.zero_grad()
    return ms


def run(prof: dapple.Profile, cluster: dapple.Cluster, first: dapple.Plan, best: dapple.Plan, slow: list[int],
        args: argparse.Namespace) -> dict:
    """On every rank: the tuned run, then the true-cost plan's run, both slowed down alike."""
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    x, y = batch(first.global_batch_size)
    pipe = dapple.pipeline(make_model(), first, F.cross_entropy, timeout=300)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    tuner = dapple.Autotuner(pipe, prof, cluster, optimizer=opt, every=args.every, margin=args.margin)
    steps, decisions, windows = [], [], []
    for step in range(args.steps):
        if step == args.slow_at:
            slow_down(pipe, slow, args.factor)
        steps.append(_step_ms(pipe, x, y, opt))
        t0 = time.perf_counter()
        if (d := tuner.step()) is not None:
            decisions.append((step, d))
            if d.action == "stay":  # the tuner's own cost at a window's end: gather, calibrate, plan, decide
                windows.append((time.perf_counter() - t0) * 1e3)
    ref = dapple.pipeline(make_model(), best, F.cross_entropy, timeout=300)
    slow_down(ref, slow, args.factor)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
    true_steps = [_step_ms(ref, x, y, ref_opt) for _ in range(args.every + 2)][2:]
    return {"steps": steps, "true_steps": true_steps, "decisions": [(s, str(d), d.action) for s, d in decisions],
            "window_ms": windows, "switch_s": [d.switch_seconds for _, d in decisions if d.switch_seconds],
            "final_plan": str(pipe.plan).splitlines()[0]}


def phases(steps: list[float], args: argparse.Namespace) -> dict[str, float]:
    two = args.slow_at + 2 * args.every + (args.every - args.slow_at % args.every) % args.every  # two windows after
    return {"before": statistics.median(steps[1:args.slow_at]), "during": statistics.median(steps[args.slow_at:two]),
            "after": statistics.median(steps[two:])}


def report(result: dict, args: argparse.Namespace) -> dict:
    ph = phases(result["steps"], args)
    true = statistics.median(result["true_steps"])
    return {**{k: round(v, 1) for k, v in ph.items()}, "true_plan": round(true, 1),
            "window_ms": round(statistics.median(result["window_ms"]), 1) if result["window_ms"] else None,
            "switch_s": round(statistics.median(result["switch_s"]), 2) if result["switch_s"] else None,
            "after_over_true": round(ph["after"] / true - 1, 4), "during_over_true": round(ph["during"] / true - 1, 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--every", type=int, default=10, help="steps per calibration window")
    p.add_argument("--margin", type=float, default=0.05)
    p.add_argument("--slow-at", type=int, default=20)
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--memory", type=float, default=16.0,
                   help="MB per device (a layer holds 1.05 MB x 4 with AdamW: at most 3 layers per device)")
    p.add_argument("--json", help="write the figures here (for --aggregate)")
    p.add_argument("--aggregate", nargs="+", metavar="JSON")
    args = p.parse_args()
    if args.aggregate:
        runs = [json.loads(Path(f).read_text()) for f in args.aggregate]
        keys = [k for k in runs[0]["report"] if isinstance(runs[0]["report"][k], float)]
        print(f"medians over {len(runs)} runs (load averages {[r['load'] for r in runs]}):")
        print(" ".join(f"{k} {statistics.median(r['report'][k] for r in runs):g}" for k in keys))
        print("per run:", [r["report"] for r in runs])
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    x, y = batch(8)
    prof = dapple.profile(make_model(), x, F.cross_entropy, batch_sizes=(2, 4, 8), targets=y, name="Emulated-8x512")
    cluster = dapple.Cluster.local(WORLD, device_memory=args.memory * 1e6)
    first = dapple.plan(prof, cluster, args.global_batch)
    slow = slowed_layers(first)
    best = dapple.plan(true_profile(prof, slow, args.factor), cluster, args.global_batch)
    print(f"first plan:\n{first}")
    print(f"slowed layers {slow} x{args.factor:g} at step {args.slow_at}; plan from the true costs:\n{best}\n")
    result = dapple.runtime.launch(run, WORLD, prof, cluster, first, best, slow, args)[0]
    rep = report(result, args)
    load = round(os.getloadavg()[0], 2)
    print(f"\n{args.steps} steps, windows of {args.every}, load average {load}, {time.perf_counter() - t0:.0f}s")
    print("| phase | median step ms | vs the true-cost plan |\n|---|---:|---:|")
    for k in ("before", "during", "after"):
        print(f"| {k} | {rep[k]:.1f} | {rep[k] / rep['true_plan'] - 1:+.1%} |")
    print(f"| true-cost plan | {rep['true_plan']:.1f} | |")
    print(f"the tuner at a window's end without a switch: {rep['window_ms']} ms (median); a switch: "
          f"{rep['switch_s']} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "load": load, "report": rep, "slowed": slow,
                                               "first": first.to_dict(), "best": best.to_dict(), **result}, indent=1))


if __name__ == "__main__":
    main()
