"""Schedule efficiency on 4 ranks with emulated-accelerator layers: dapple vs torch.distributed.pipelining.

Each of 4 straight stages holds one ``EmulatedLayer`` that sleeps ``ms_per_row`` per row forward and twice
that backward (the CPU stays free, as with a GPU kernel), so a micro-batch of b rows costs F = b*ms forward
and B = 2F backward on every stage, and the ideal step is (M + S - 1)(F + B). Efficiency = ideal / measured
median step time ("vs ops": the ideal from the measured durations of the emulated ops, which overshoot
their nominal time). dapple and PiPPy (Schedule1F1B, ScheduleGPipe) run the same stages and micro-batches.

    PYTHONPATH=$PWD python benchmarks/schedule_efficiency.py            # 4 processes, prints a table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dapple
from _timing import timed_steps  # benchmarks/_timing.py
from dapple.models import EmulatedNet
from dapple.planner import Stage
from dapple.profiler import trace_layers

S = 4


def _model(ms: float, width: int) -> EmulatedNet:
    torch.manual_seed(0)
    return EmulatedNet([ms] * S, width=width)


def run(args: argparse.Namespace) -> dict:
    """Build every engine, warm each up, then time them in interleaved rounds (load drifts hit all alike)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    torch.set_num_threads(1)
    b, m = args.micro_batch, args.micro_batches
    x = torch.randn(b * m, args.width)
    y = torch.randint(0, 4, (b * m,))
    steps, pipes = {}, {}
    for name, schedule, policy in (("dapple/A", "dapple", "A"), ("dapple/B", "dapple", "B"),
                                   ("dapple/gpipe", "gpipe", "A")):
        model = _model(args.ms_per_row, args.width)
        plan = dapple.Plan(global_batch_size=b * m, micro_batch_size=b, schedule=schedule, warmup_policy=policy,
                           stages=[Stage((0, 1), [0]), Stage((1, 2), [1]), Stage((2, 3), [2]), Stage((3, 5), [3])],
                           layer_names=trace_layers(model).names)
        pipe = dapple.pipeline(model, plan, F.cross_entropy, timeout=120)
        steps[name] = lambda pipe=pipe: pipe.train_step(x, y)
        pipes[name] = pipe
    rank = dist.get_rank()
    for name, cls in (("pippy/1F1B", Schedule1F1B), ("pippy/GPipe", ScheduleGPipe)):
        model = _model(args.ms_per_row, args.width)
        mods = [model.layers[s] for s in range(S)]
        stage_mod = nn.Sequential(mods[rank], model.head) if rank == S - 1 else nn.Sequential(mods[rank])
        sched = cls(PipelineStage(stage_mod, rank, S, torch.device("cpu")), n_microbatches=m,
                    loss_fn=F.cross_entropy)

        def step(sched=sched) -> None:
            if rank == 0:
                sched.step(x)
            elif rank == S - 1:
                sched.step(target=y)
            else:
                sched.step()
        steps[name] = step
    for step in steps.values():
        timed_steps(step, args.warmup)
    results: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            results[name] += [w for w, _ in timed_steps(step, args.steps)]
    return {"step_ms": results, "op_ms": _op_durations(pipes["dapple/A"], steps["dapple/A"], args.steps)}


def _op_durations(pipe, step, steps: int) -> dict | None:
    """Rank 0: per stage, the median duration of its F and B ops over ``steps`` traced steps (the emulated
    ops overshoot their nominal time: sleep wake-up, the Linear, autograd), for an ideal from measured ops."""
    with pipe.trace() as t:
        for _ in range(steps):
            step()
    gathered = t.gather()
    if gathered is None:
        return None
    out: dict = {}
    for e in gathered[0]:
        if e.kind in ("forward", "backward"):
            out.setdefault(e.rank, {}).setdefault(e.kind[0].upper(), []).append(1e3 * e.duration)
    return {r: {k: statistics.median(v) for k, v in d.items()} for r, d in sorted(out.items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms-per-row", type=float, default=1.0)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=16)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", help="also write the raw step times here")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    got = dapple.runtime.launch(run, S, args)[0]
    res, ops = got["step_ms"], got["op_ms"]
    f = args.micro_batch * args.ms_per_row
    ideal = (args.micro_batches + S - 1) * (f + 2 * f)  # (M + S - 1)(F + B)
    # the same with the slowest stage's measured op durations F' + B' (traced dapple/A steps)
    fb = max(d["F"] + d["B"] for d in ops.values())
    ideal_ops = (args.micro_batches + S - 1) * fb
    print(f"S={S} M={args.micro_batches} micro-batch={args.micro_batch} F={f:g} ms B={2 * f:g} ms "
          f"ideal step={ideal:.1f} ms; {args.rounds} interleaved rounds x {args.steps} steps, medians")
    print("measured op medians per stage (ms): " + ", ".join(f"{r}: F'={d['F']:.2f} B'={d['B']:.2f}"
                                                              for r, d in ops.items()))
    print(f"ideal from measured ops (M + S - 1)(F' + B') = {ideal_ops:.1f} ms")
    print(f"{'engine':<14}{'median ms':>10}{'min ms':>9}{'efficiency':>12}{'vs ops':>9}")
    for name, ts in res.items():
        med = statistics.median(ts)
        print(f"{name:<14}{med:>10.1f}{min(ts):>9.1f}{ideal / med:>12.3f}{ideal_ops / med:>9.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "ideal_ms": ideal, "ideal_ops_ms": ideal_ops, "op_ms": ops, "step_ms": res}, fh, indent=1)


if __name__ == "__main__":
    main()
