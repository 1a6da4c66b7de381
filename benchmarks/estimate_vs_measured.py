"""Planner estimate vs measured step time on 4 local ranks (gloo), per plan shape, emulated accelerator.

A model of emulated-accelerator layers (each holds its rank ``ms_per_row`` per row forward and twice that
backward, releasing the CPU like a GPU kernel; five also hold an MLP of 0.6 to 4.3 MB of parameters, so the
gradient AllReduce matters) is profiled with ``dapple.profile`` on this machine and planned for
``Cluster.local(4)`` (P2P and AllReduce latency/bandwidth measured with gloo): the planner's own choice
(``dapple.plan``) and forced shapes (pure DP on 4, straight 4 stages, hybrids 2->1->1 and 2:2, cut where the
profile balances them) at two micro-batch counts. Each plan runs on 4 ranks; the median ``train_step`` time
(all ranks start after a barrier, a step lasts until the slowest rank returns; gradients dropped between steps,
no optimizer step) is compared with the planner's estimate (``dapple.evaluate``, refined and paper models) and
the event simulator's prediction (``dapple.simulate``). Plans run in interleaved rounds, each first in turn.

Then, from traced steps of every plan (``pipe.trace()``), where the time went against the model (helpers in
``accuracy_traces.py``): per-op forward/backward vs the profile, the gradient AllReduce and the replicas' skew
before it, P2P delivery vs the cluster fit, the runtime's time between ops. ``--pictures DIR`` draws a measured
step above the simulated one (same colours, same time scale) for ``--picture-plans``.

    PYTHONPATH=$PWD python benchmarks/estimate_vs_measured.py --json run1.json      # ~3.5 minutes
    PYTHONPATH=$PWD python benchmarks/estimate_vs_measured.py --aggregate run1.json run2.json run3.json
    PYTHONPATH=$PWD python benchmarks/estimate_vs_measured.py --pictures docs/ --traces /tmp/traces
    PYTHONPATH=$PWD python benchmarks/estimate_vs_measured.py --contention   # the layers' real compute, 1 vs 4 ranks
    ACCURACY_NO_MLP=1 PYTHONPATH=$PWD python benchmarks/estimate_vs_measured.py --only DP   # without the MLPs
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import timed_steps  # noqa: E402  (benchmarks/, next to this script)
from accuracy_traces import contention, diagnose, side_by_side  # noqa: E402  (benchmarks/, next to this script)

import dapple  # noqa: E402
from dapple.models import EmulatedLayer  # noqa: E402
from dapple.planner import Stage  # noqa: E402

WORLD = 4
WIDTH = 128  # boundary width: activations are WIDTH * 4 bytes per row
MS_PER_ROW = [1.5, 4.0, 2.0, 3.0, 1.5, 4.0, 2.5, 2.0]  # forward ms per row of each layer (backward 2x)
HIDDEN = [0, 4096, 512, 2048, 0, 4096, 1024, 2048]  # MLP width of each layer (0: none); 4096: 4.2 MB
if os.environ.get("ACCURACY_NO_MLP"):  # diagnosis: no MLPs, so almost no real compute (and tiny AllReduces)
    HIDDEN = [0] * len(HIDDEN)
CLASSES = 4
PROFILE_BATCHES = (1, 2, 4, 8)


class Block(nn.Module):
    """One layer: an optional residual MLP (WIDTH -> hidden -> WIDTH: real compute, and the parameters the
    AllReduce moves), then an EmulatedLayer that holds the rank ``ms_per_row`` ms per row (2x backward)."""

    def __init__(self, width: int, hidden: int, ms_per_row: float):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, width)) if hidden else None
        self.emu = EmulatedLayer(width, ms_per_row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, width) -> (B, width)
        if self.mlp is not None:
            x = x + self.mlp(x)
        return self.emu(x)


class Net(nn.Module):
    """Blocks then a linear head: x (B, WIDTH) -> (B, CLASSES). Layers: layers.0 .. layers.7, head."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(WIDTH, h, ms) for h, ms in zip(HIDDEN, MS_PER_ROW)])
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, WIDTH, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


# ---- plans ---------------------------------------------------------------------------------------------
def _cuts(weights: list[float], shares: list[float]) -> list[int]:
    """Cut points splitting ``weights`` into len(shares) non-empty ranges with sums close to ``shares``."""
    total, out, acc, k, target = sum(weights), [], 0.0, 0, 0.0
    for share in shares[:-1]:
        target += share * total
        while k < len(weights) and acc + weights[k] / 2 < target:
            acc += weights[k]
            k += 1
        out.append(max(k, out[-1] + 1 if out else 1))
    return out


def forced_shapes(prof: dapple.Profile, rows: int) -> dict[str, list[tuple]]:
    """Pure DP, straight and hybrid stages on 4 devices, cut where forward+backward per device balances at
    ``rows`` rows per replica."""
    n, c = prof.num_layers, prof.costs(rows)
    w = [f + b for f, b in zip(c.forward_ms, c.backward_ms)]
    s4, h211, h22 = _cuts(w, [0.25] * 4), _cuts(w, [0.5, 0.25, 0.25]), _cuts(w, [0.5, 0.5])
    return {"DP x4": [(0, n, [0, 1, 2, 3])],
            "straight 4": [(0, s4[0], [0]), (s4[0], s4[1], [1]), (s4[1], s4[2], [2]), (s4[2], n, [3])],
            "hybrid 2->1->1": [(0, h211[0], [0, 1]), (h211[0], h211[1], [2]), (h211[1], n, [3])],
            "hybrid 2:2": [(0, h22[0], [0, 1]), (h22[0], n, [2, 3])]}


def make_plans(prof: dapple.Profile, cluster: dapple.Cluster, g: int, micros: list[int], overlap: bool
               ) -> list[tuple[str, dapple.Plan]]:
    """Per micro-batch size: dapple.plan's choice, then the forced shapes (warmup K_i as the planner sets it)."""
    out = []
    for b in micros:
        chosen = dapple.plan(prof, cluster, g, micro_batch_size=b, overlap=overlap)
        out.append((f"planner (M={g // b})", chosen))
        for name, st in forced_shapes(prof, max(1, b // 2)).items():
            est = dapple.evaluate(prof, cluster, st, g, b, model="refined", overlap=overlap)
            stages = [Stage((a, c), ds, k["warmup"]) for (a, c, ds), k in zip(st, est.details["stages"])]
            out.append((f"{name} (M={g // b})", dapple.Plan(g, b, stages, layer_names=list(prof.layer_names))))
    return out


def describe(plan: dapple.Plan) -> str:
    """``0-4x2 4-9x2 K3,1``: layer ranges x replicas, then the warmup K_i."""
    return (" ".join(f"{s.layers[0]}-{s.layers[1]}x{s.replicas}" for s in plan.stages)
            + " K" + ",".join(str(k) for k in plan.warmup))


# ---- measuring (every rank) ------------------------------------------------------------------------------
def _timed(pipe: dapple.Pipeline, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    """Step durations in ms (the slowest rank's); gradients dropped before each step, outside the timing."""
    def drop_grads() -> None:
        for p in pipe.parameters():
            p.grad = None
    return [w for w, _ in timed_steps(lambda: pipe.train_step(x, y), steps, before=drop_grads)]


def run(plans: list[tuple[str, dapple.Plan]], args: argparse.Namespace, trace_dir: str) -> dict:
    """On every rank: build each plan's pipeline, warm up, time interleaved rounds, then trace a few steps."""
    torch.set_num_threads(1)
    x, y = batch(args.global_batch)
    pipes = {name: dapple.pipeline(make_model(), plan, F.cross_entropy, timeout=120) for name, plan in plans}
    for pipe in pipes.values():
        _timed(pipe, x, y, args.warmup)
    results: dict[str, list[float]] = {name: [] for name in pipes}
    for r in range(args.rounds):
        order = list(pipes)
        order = order[r % len(order):] + order[:r % len(order)]  # each plan first in turn
        for name in order:
            results[name] += _timed(pipes[name], x, y, args.steps)
    for i, pipe in enumerate(pipes.values()):
        with pipe.trace() as t:
            _timed(pipe, x, y, args.trace_steps)
        t.save(Path(trace_dir) / f"plan{i}.json")
    return results


# ---- main ------------------------------------------------------------------------------------------------
def table(rows: list[dict]) -> str:
    head = ("| plan | stages (layers x replicas, K_i) | measured ms | refined ms | paper ms | simulated ms "
            "| err refined | err paper | err simulated |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
    return head + "\n".join(
        f"| {r['plan']} | {r['stages']} | {r['measured_ms']:.0f} | {r['refined_ms']:.0f} | {r['paper_ms']:.0f} | "
        f"{r['simulated_ms']:.0f} | {r['err_refined']:+.1%} | {r['err_paper']:+.1%} | {r['err_simulated']:+.1%} |"
        for r in rows)


def diag_table(rows: list[dict]) -> str:
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)
    head = ("| plan | op / profile | AllReduce ms (model) | replica skew ms | P2P delivery ms (model) "
            "| runtime ms between ops | traced step ms |\n|---|---:|---:|---:|---:|---:|---:|\n")
    return head + "\n".join(
        f"| {r['plan']} | {f(d['op_over_profile'], '.3f')} | {f(d['allreduce_ms'])} ({f(d['allreduce_model_ms'])}) "
        f"| {f(d['skew_ms'])} | {f(d['delivery_ms'], '.2f')} ({f(d['delivery_model_ms'], '.2f')}) "
        f"| {f(d['gap_per_op_ms'], '.2f')} | {f(d['traced_step_ms'], '.0f')} |"
        for r in rows for d in [r["diagnosis"]])


def aggregate(paths: list[str]) -> None:
    """Per plan, the median over runs of each figure (and of each error), as the tables."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    out = []
    for i, r0 in enumerate(runs[0]["rows"]):
        rs = [run["rows"][i] for run in runs]
        row = {k: statistics.median(r[k] for r in rs) for k in r0 if isinstance(r0[k], float)}
        row.update(plan=r0["plan"], stages=" / ".join(sorted({r["stages"] for r in rs})))
        row["diagnosis"] = {k: (statistics.median(v) if (v := [r["diagnosis"][k] for r in rs
                                                                if r["diagnosis"][k] is not None]) else None)
                            for k in r0["diagnosis"]}
        out.append(row)
    print(f"medians over {len(runs)} runs (load averages {[run['load'] for run in runs]})\n")
    print(table(out) + "\n\n" + diag_table(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro", type=int, nargs="+", default=[8, 4], help="micro-batch sizes (M = global / micro)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per plan per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--trace-steps", type=int, default=3, help="traced steps per plan (diagnosis, pictures)")
    p.add_argument("--overlap", action="store_true", help="plan and estimate with overlapped AllReduce")
    p.add_argument("--only", help="run only the plans whose name contains this")
    p.add_argument("--traces", help="keep the traces (plan<i>.json), plans, profile and cluster here")
    p.add_argument("--pictures", help="draw measured vs simulated Gantt PNGs of --picture-plans here")
    p.add_argument("--picture-plans", nargs="+", default=["hybrid 2:2 (M=8)"], help="plan names to draw")
    p.add_argument("--json", help="write every figure here (for --aggregate)")
    p.add_argument("--aggregate", nargs="+", metavar="JSON", help="only print the medians of earlier --json runs")
    p.add_argument("--contention", action="store_true", help="only time the model's layers on 1..4 ranks at once")
    args = p.parse_args()
    if args.aggregate:
        return aggregate(args.aggregate)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if args.contention:
        res = dapple.runtime.launch(contention, WORLD, make_model, batch, WORLD)[0]
        print("whole-model forward / backward ms on rank 0 with k ranks computing at once (2 cores):")
        for rows in sorted({r for r, _ in res}):
            one = res[(rows, 1)]
            print(f"  {rows} row(s): " + ", ".join(
                f"k={k}: {res[(rows, k)][0]:.1f} / {res[(rows, k)][1]:.1f} (x{sum(res[(rows, k)]) / sum(one):.3f})"
                for k in range(1, WORLD + 1)))
        return None
    t0 = time.perf_counter()
    x, y = batch(max(PROFILE_BATCHES))
    prof = dapple.profile(make_model(), x, F.cross_entropy, batch_sizes=PROFILE_BATCHES, targets=y, name="Net")
    t_prof = time.perf_counter() - t0
    cluster = dapple.Cluster.local(WORLD)
    ar = cluster.intra_allreduce_by_size or {}
    print(f"profiled in {t_prof:.0f}s; {cluster}; AllReduce (latency per ring step, bus bandwidth) by group size: "
          + ", ".join(f"{r}: {v[0] * 1e6:.0f} us, {v[1] / 1e9:.2f} GB/s" for r, v in ar.items()))
    plans = make_plans(prof, cluster, args.global_batch, args.micro, args.overlap)
    if args.only:
        plans = [(n, pl) for n, pl in plans if args.only in n]
    trace_dir = Path(args.traces) if args.traces else Path(tempfile.mkdtemp(prefix="dapple_accuracy_"))
    trace_dir.mkdir(parents=True, exist_ok=True)
    prof.save(trace_dir / "profile.yaml")
    cluster.save(trace_dir / "cluster.yaml")
    for i, (_, plan) in enumerate(plans):
        plan.save(trace_dir / f"plan{i}.yaml")
    measured = dapple.runtime.launch(run, WORLD, plans, args, str(trace_dir))[0]
    from dapple.core.timeline import load_chrome_trace
    rows = []
    for i, (name, plan) in enumerate(plans):
        med = statistics.median(measured[name])
        ref = dapple.evaluate(prof, cluster, plan, model="refined", overlap=args.overlap).latency_ms
        pap = dapple.evaluate(prof, cluster, plan, model="paper", overlap=args.overlap).latency_ms
        sim = dapple.simulate(plan, prof, cluster, overlap=args.overlap).latency_ms
        diag = diagnose(plan, load_chrome_trace(trace_dir / f"plan{i}.json"), prof, cluster)
        rows.append({"plan": name, "stages": describe(plan), "measured_ms": med, "refined_ms": ref, "paper_ms": pap,
                     "simulated_ms": sim, "err_refined": ref / med - 1, "err_paper": pap / med - 1,
                     "err_simulated": sim / med - 1, "step_ms": measured[name], "diagnosis": diag})
    load = round(os.getloadavg()[0], 2)
    print(f"\n{len(plans)} plans x {args.rounds} rounds x {args.steps} steps (medians), load average {load}, "
          f"{time.perf_counter() - t0:.0f}s in all\n")
    print(table(rows) + "\n\n" + diag_table(rows))
    if args.pictures:
        Path(args.pictures).mkdir(parents=True, exist_ok=True)
        for i, (name, plan) in enumerate(plans):
            if name in args.picture_plans:
                slug = "".join(c if c.isalnum() else "_" for c in name).strip("_").replace("__", "_")
                out = side_by_side(trace_dir / f"plan{i}.json", plan, prof, cluster,
                                   Path(args.pictures) / f"estimate_vs_measured_{slug}.png", f"{name} {describe(plan)}")
                print(f"drew {out}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "load": load,
                                               "cluster": cluster.to_dict(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
