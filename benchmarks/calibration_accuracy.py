"""Estimate vs measured before and after ``dapple.calibrate``, on the traced plan and on plans it never saw.

A built-in model is profiled on this machine (one process) and planned for ``Cluster.local(4)`` (links and
AllReduce measured with gloo); the shapes of ``estimate_vs_measured.py`` (pure DP on 4, straight 4 stages,
hybrids 2->1->1 and 2:2, cut where the profile balances them) run on 4 ranks, each traced for ``--steps`` steps
after ``--warmup``. Measured = the median traced step (the ranks' ``train_step`` spans). For every plan P, the
documents are calibrated from P's trace alone; then every plan Q's refined estimate (``dapple.evaluate``,
AllReduce overlapped as the runtime runs it) and simulated step (``dapple.simulate``) are compared with Q's
measured step: "self" where Q = P (the running plan), "held out" the median absolute error over P != Q.

    PYTHONPATH=$PWD python benchmarks/calibration_accuracy.py --model emulated      # estimate_vs_measured's Net
    PYTHONPATH=$PWD python benchmarks/calibration_accuracy.py --model gpt           # real compute: 4 ranks, 2 cores
    PYTHONPATH=$PWD python benchmarks/calibration_accuracy.py --model resnet
    PYTHONPATH=$PWD python benchmarks/calibration_accuracy.py --aggregate a.json b.json c.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import estimate_vs_measured as evm  # noqa: E402  (benchmarks/, next to this script)

import dapple  # noqa: E402
from dapple.models import GPT, ResNet, lm_loss, random_tokens  # noqa: E402
from dapple.planner import Stage  # noqa: E402

WORLD = 4


def model_spec(name: str):
    """(make_model, batch(n) -> (x, y), loss_fn, profiled batch sizes, global batch, micro-batch) of a model."""
    if name == "emulated":
        return evm.make_model, evm.batch, F.cross_entropy, evm.PROFILE_BATCHES, 32, 8
    if name == "gpt":
        def make() -> GPT:
            torch.manual_seed(0)
            return GPT(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=64)

        def batch(n: int):
            return random_tokens(n, 32, 256, generator=torch.Generator().manual_seed(1))
        return make, batch, lm_loss, (2, 4), 32, 8
    if name == "resnet":
        def make_resnet() -> ResNet:
            torch.manual_seed(0)
            return ResNet(widths=(16, 32), depth=2, num_classes=10)

        def images(n: int):
            g = torch.Generator().manual_seed(1)
            return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
        return make_resnet, images, F.cross_entropy, (2, 4), 32, 8
    raise ValueError(f"--model: expected emulated, gpt or resnet, got {name!r}")


def plans_for(prof: dapple.Profile, cluster: dapple.Cluster, g: int, b: int) -> list[tuple[str, dapple.Plan]]:
    """The forced shapes at micro-batch ``b``, K_i as the planner sets them."""
    out = []
    for name, st in evm.forced_shapes(prof, max(1, b // 2)).items():
        est = dapple.evaluate(prof, cluster, st, g, b, model="refined", overlap=True)
        stages = [Stage((a, c), ds, k["warmup"]) for (a, c, ds), k in zip(st, est.details["stages"])]
        out.append((name, dapple.Plan(g, b, stages, layer_names=list(prof.layer_names),
                                      meta={"latency_model": "refined", "overlap": True})))
    return out


def run(model_name: str, plans: list[tuple[str, dapple.Plan]], args: argparse.Namespace, out: str) -> None:
    """On every rank: each plan's pipeline, ``args.warmup`` steps, then ``args.steps`` traced ones, saved."""
    torch.set_num_threads(1)
    make, batch, loss_fn, _, g, _ = model_spec(model_name)
    x, y = batch(g)
    for i, (_, plan) in enumerate(plans):
        pipe = dapple.pipeline(make(), plan, loss_fn, timeout=300)
        for _ in range(args.warmup):
            pipe.train_step(x, y)
        with pipe.trace() as t:
            for _ in range(args.steps):
                pipe.train_step(x, y)
        t.save(Path(out) / f"plan{i}.json")


def table(rows: list[dict]) -> str:
    head = ("| plan | measured ms | before: estimate, simulated | after, self: estimate, simulated "
            "| after, held out (median abs): estimate, simulated |\n|---|---:|---|---|---|\n")

    def pct(v):
        return "-" if v is None else f"{v:+.1%}"
    return head + "\n".join(
        f"| {r['plan']} | {r['measured_ms']:.0f} | {pct(r['before_estimate'])}, {pct(r['before_simulated'])} | "
        f"{pct(r['self_estimate'])}, {pct(r['self_simulated'])} | "
        f"{'-' if r['held_estimate'] is None else format(r['held_estimate'], '.1%')}, "
        f"{'-' if r['held_simulated'] is None else format(r['held_simulated'], '.1%')} |" for r in rows)


def evaluate_all(prof, cluster, plans, traces) -> list[dict]:
    """Per plan: measured, the errors before, after calibrating from its own trace, and from the others'."""
    measured = [dapple.calibration.median_step_ms(t) for t in traces]
    cal = [dapple.calibrate(prof, cluster, t) for t in traces]

    def errors(q: int, p, c) -> dict:
        pred = dapple.calibration.predictions(plans[q][1], p, c)
        return {k: None if v is None else v / measured[q] - 1 for k, v in pred.items()}
    rows = []
    for q, (name, _) in enumerate(plans):
        before, own = errors(q, prof, cluster), errors(q, *cal[q])
        held = [errors(q, *cal[p]) for p in range(len(plans)) if p != q]
        rows.append({"plan": name, "measured_ms": measured[q],
                     "before_estimate": before["estimate"], "before_simulated": before["simulated"],
                     "self_estimate": own["estimate"], "self_simulated": own["simulated"],
                     "held_estimate": _median_abs([h["estimate"] for h in held]),
                     "held_simulated": _median_abs([h["simulated"] for h in held]),
                     "scales": cal[q][0].meta["calibration"]["stages"][0],
                     "overhead_ms_per_op": cal[q][0].meta["calibration"]["overhead_ms_per_op"]})
    return rows


def _median_abs(values: list) -> float | None:
    values = [abs(v) for v in values if v is not None]
    return statistics.median(values) if values else None


def aggregate(paths: list[str]) -> None:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    rows = []
    for i, r0 in enumerate(runs[0]["rows"]):
        rs = [run["rows"][i] for run in runs]
        row = {"plan": r0["plan"]}
        for k in r0:
            if k not in ("plan", "scales"):
                vals = [r[k] for r in rs if r[k] is not None]
                row[k] = statistics.median(vals) if vals else None
        rows.append(row)
    print(f"medians over {len(runs)} runs of {runs[0]['model']} (load averages {[r['load'] for r in runs]})\n")
    print(table(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="emulated", choices=["emulated", "gpt", "resnet"])
    p.add_argument("--steps", type=int, default=6, help="traced steps per plan")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--traces", help="keep the traces, plans, profile and cluster here")
    p.add_argument("--json", help="write every figure here (for --aggregate)")
    p.add_argument("--aggregate", nargs="+", metavar="JSON")
    args = p.parse_args()
    if args.aggregate:
        return aggregate(args.aggregate)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    make, batch, loss_fn, sizes, g, b = model_spec(args.model)
    x, y = batch(max(sizes))
    prof = dapple.profile(make(), x, loss_fn, batch_sizes=sizes, targets=y, name=args.model)
    cluster = dapple.Cluster.local(WORLD)
    plans = plans_for(prof, cluster, g, b)
    out = Path(args.traces) if args.traces else Path(tempfile.mkdtemp(prefix="dapple_calibration_"))
    out.mkdir(parents=True, exist_ok=True)
    prof.save(out / "profile.yaml")
    cluster.save(out / "cluster.yaml")
    dapple.runtime.launch(run, WORLD, args.model, plans, args, str(out))
    traces = [str(out / f"plan{i}.json") for i in range(len(plans))]
    rows = evaluate_all(prof, cluster, plans, traces)
    load = round(os.getloadavg()[0], 2)
    print(f"{args.model}: {len(plans)} plans x {args.steps} traced steps, load average {load}, "
          f"{time.perf_counter() - t0:.0f}s; traces in {out}\n")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "load": load, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
