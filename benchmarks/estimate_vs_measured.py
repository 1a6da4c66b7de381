"""Planner estimate vs measured step time on 4 local ranks (gloo), per plan shape, emulated accelerator.

A model of emulated-accelerator layers (each holds its rank ``ms_per_row`` per row forward and twice that
backward, releasing the CPU like a GPU kernel; some also hold an MLP of MBs of parameters, so the gradient
AllReduce matters) is profiled with ``dapple.profile`` on this machine and planned for ``Cluster.local(4)``
(P2P and AllReduce latency/bandwidth measured with gloo): the planner's own choice (``dapple.plan``) and forced
shapes (pure DP on 4, straight 4 stages, hybrids 2->1->1 and 2:2) at two micro-batch counts. Each plan then
runs on 4 ranks; the median ``train_step`` time (all ranks start after a barrier, a step lasts until the
slowest rank returns; no optimizer step) is compared with the planner's estimate (refined and paper models,
``dapple.evaluate``) and the event simulator's prediction (``dapple.simulate``).

    PYTHONPATH=$PWD python benchmarks/estimate_vs_measured.py                 # a few minutes, prints a table
    PYTHONPATH=$PWD python benchmarks/estimate_vs_measured.py --traces out/   # also one traced step per plan
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dapple  # noqa: E402
from dapple.models import EmulatedLayer  # noqa: E402
from dapple.planner import Stage  # noqa: E402

WORLD = 4
WIDTH = 128  # boundary width: activations are WIDTH * 4 bytes per row
MS_PER_ROW = [1.5, 4.0, 2.0, 3.0, 1.5, 4.0, 2.5, 2.0]  # forward ms per row of each layer (backward 2x)
HIDDEN = [0, 4096, 512, 2048, 0, 4096, 1024, 2048]  # MLP width of each layer (0: none); 4096: 4.2 MB
CLASSES = 4


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
    """Blocks then a linear head: x (B, WIDTH) -> (B, CLASSES)."""

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
def shapes(n: int) -> dict[str, list[tuple]]:
    """Forced plan shapes over ``n`` layers on 4 devices, cut where the profile's compute balances."""
    return {"DP x4": [(0, n, [0, 1, 2, 3])],
            "straight 4": [(0, 3, [0]), (3, 5, [1]), (5, 7, [2]), (7, n, [3])],
            "hybrid 2->1->1": [(0, 4, [0, 1]), (4, 7, [2]), (7, n, [3])],
            "hybrid 2:2": [(0, 5, [0, 1]), (5, n, [2, 3])]}


def balanced_shapes(prof: dapple.Profile, rows: int) -> dict[str, list[tuple]]:
    """The forced shapes with cuts that balance forward+backward per device at ``rows`` rows per micro-batch."""
    n = prof.num_layers
    c = prof.costs(rows)
    w = [f + b for f, b in zip(c.forward_ms, c.backward_ms)]

    def cuts(weights: list[float], parts: list[float]) -> list[int]:
        """Cut points splitting ``weights`` into len(parts) ranges with shares close to ``parts``."""
        total, out, acc, k = sum(weights), [], 0.0, 0
        target = 0.0
        for share in parts[:-1]:
            target += share * total
            while k < len(weights) and acc + weights[k] / 2 < target:
                acc += weights[k]
                k += 1
            out.append(max(k, (out[-1] + 1) if out else 1))
        return out

    s4 = cuts(w, [0.25] * 4)
    h211 = cuts(w, [0.5, 0.25, 0.25])
    h22 = cuts(w, [0.5, 0.5])
    return {"DP x4": [(0, n, [0, 1, 2, 3])],
            "straight 4": [(0, s4[0], [0]), (s4[0], s4[1], [1]), (s4[1], s4[2], [2]), (s4[2], n, [3])],
            "hybrid 2->1->1": [(0, h211[0], [0, 1]), (h211[0], h211[1], [2]), (h211[1], n, [3])],
            "hybrid 2:2": [(0, h22[0], [0, 1]), (h22[0], n, [2, 3])]}


def make_plans(prof: dapple.Profile, cluster: dapple.Cluster, g: int, micros: list[int], overlap: bool
               ) -> list[tuple[str, dapple.Plan]]:
    out = []
    for b in micros:
        chosen = dapple.plan(prof, cluster, g, micro_batch_size=b, overlap=overlap)
        out.append((f"planner's (M={g // b})", chosen))
        for name, st in balanced_shapes(prof, b // 2).items():
            est = dapple.evaluate(prof, cluster, st, g, b, model="refined", overlap=overlap)
            stages = [Stage((a, c), ds, k["warmup"]) for (a, c, ds), k in zip(st, est.details["stages"])]
            out.append((f"{name} (M={g // b})", dapple.Plan(g, b, stages, layer_names=list(prof.layer_names))))
    return out


# ---- measuring -------------------------------------------------------------------------------------------
def _timed(pipe: dapple.Pipeline, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    """Step durations in ms: all ranks start after a barrier; a step lasts until the slowest rank is done.
    Gradients are dropped before each step (as ``optimizer.zero_grad()`` does), outside the timing."""
    out = []
    for _ in range(steps):
        for p in pipe.parameters():
            p.grad = None
        dist.barrier()
        t0 = time.perf_counter()
        pipe.train_step(x, y)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.append(1e3 * float(t))
    return out


def run(plans: list[tuple[str, dapple.Plan]], args: argparse.Namespace) -> dict:
    """On every rank: build each plan's pipeline, warm up, trace one step, then time interleaved rounds."""
    torch.set_num_threads(1)
    x, y = batch(args.global_batch)
    pipes = {name: dapple.pipeline(make_model(), plan, F.cross_entropy, timeout=120) for name, plan in plans}
    for pipe in pipes.values():
        _timed(pipe, x, y, args.warmup)
    if args.traces:
        for i, (name, pipe) in enumerate(pipes.items()):
            dist.barrier()
            with pipe.trace() as t:
                _timed(pipe, x, y, args.trace_steps)
            t.save(Path(args.traces) / f"plan{i}.json")
    results: dict[str, list[float]] = {name: [] for name in pipes}
    for r in range(args.rounds):
        order = list(pipes)
        order = order[r % len(order):] + order[:r % len(order)]  # each plan first in turn
        for name in order:
            results[name] += _timed(pipes[name], x, y, args.steps)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro", type=int, nargs="+", default=[8, 4], help="micro-batch sizes (M = global / micro)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--overlap", action="store_true", help="plan and estimate with overlapped AllReduce")
    p.add_argument("--traces", help="directory for one traced step per plan (Chrome JSON) and the plans")
    p.add_argument("--only", help="run only the plans whose name contains this")
    p.add_argument("--trace-steps", type=int, default=1, help="steps per traced plan")
    p.add_argument("--json", help="also write all figures here")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    x, y = batch(8)
    prof = dapple.profile(make_model(), x, F.cross_entropy, batch_sizes=(1, 2, 4, 8), targets=y, name="Net")
    t_prof = time.perf_counter() - t0
    cluster = dapple.Cluster.local(WORLD)
    t_cl = time.perf_counter() - t0 - t_prof
    print(f"profiled in {t_prof:.1f}s, {cluster} (probe {t_cl:.1f}s); AllReduce bus "
          f"{(cluster.intra_allreduce_bandwidth or 0) / 1e9:.3g} GB/s + "
          f"{(cluster.intra_allreduce_latency or 0) * 1e6:.0f} us per ring step")
    plans = make_plans(prof, cluster, args.global_batch, args.micro, args.overlap)
    if args.only:
        plans = [(n, p) for n, p in plans if args.only in n]
    if args.traces:
        Path(args.traces).mkdir(parents=True, exist_ok=True)
        prof.save(Path(args.traces) / "profile.yaml")
        cluster.save(Path(args.traces) / "cluster.yaml")
        for i, (name, plan) in enumerate(plans):
            plan.save(Path(args.traces) / f"plan{i}.yaml")
    measured = dapple.runtime.launch(run, WORLD, plans, args)[0]
    rows = []
    print(f"\n{'plan':<24}{'stages':<34}{'measured':>9}{'refined':>9}{'paper':>9}{'sim':>9}"
          f"{'err ref':>9}{'err pap':>9}{'err sim':>9}")
    for name, plan in plans:
        med = statistics.median(measured[name])
        ref = dapple.evaluate(prof, cluster, plan, model="refined", overlap=args.overlap).latency_ms
        pap = dapple.evaluate(prof, cluster, plan, model="paper", overlap=args.overlap).latency_ms
        sim = dapple.simulate(plan, prof, cluster, overlap=args.overlap).latency_ms
        desc = " ".join(f"{s.layers[0]}-{s.layers[1]}x{s.replicas}" for s in plan.stages)
        rows.append({"plan": name, "stages": desc, "measured_ms": med, "refined_ms": ref, "paper_ms": pap,
                     "simulated_ms": sim, "all_ms": measured[name]})
        print(f"{name:<24}{desc:<34}{med:>9.1f}{ref:>9.1f}{pap:>9.1f}{sim:>9.1f}"
              f"{ref / med - 1:>+9.1%}{pap / med - 1:>+9.1%}{sim / med - 1:>+9.1%}")
    print(f"total {time.perf_counter() - t0:.0f}s; load average {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
