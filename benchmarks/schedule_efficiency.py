"""Schedule efficiency on 4 ranks with emulated-accelerator layers: dapple (1F1B, gpipe, zero bubble) vs
torch.distributed.pipelining.

Each of 4 straight stages holds two ``EmulatedLayer`` of ``ms_per_row / 2`` per row forward and twice that
backward, half of it on the weight's own path (weight-gradient work, ``weight_share=0.5``; the CPU stays free, as
with a GPU kernel), so a micro-batch of b rows costs F = b*ms forward and B = 2F backward (B/2 input gradients,
B/2 weight gradients) on every stage, and the ideal 1F1B step is (M + S - 1)(F + B). Efficiency = ideal /
measured median step ("vs ops": the ideal from the measured durations of the emulated ops, which overshoot their
nominal time). dapple and PiPPy run the same layers and micro-batches: one stage of two layers per rank
(Schedule1F1B, ScheduleGPipe), or two stages of one layer per rank (ScheduleInterleaved1F1B and
ScheduleInterleavedZeroBubble: layers r and r + 4 on rank r; ScheduleZBVZeroBubble and ScheduleDualPipeV: layers r
and 7 - r); dapple's interleaved-1f1b and zb-v run the same two chunks per rank (a Plan of 8 stages, two per
device). Ratios: ZB / X = X's median step over dapple zb-h1's; "dapple / PiPPy" = dapple's median step over PiPPy's
on the same placement; the simulated ones from ``dapple.planner.simulate`` on the nominal costs.

    PYTHONPATH=$PWD python benchmarks/schedule_efficiency.py --micro-batches 8      # 4 processes, prints a table
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _timing import timed_steps  # benchmarks/_timing.py
from torch import nn

import dapple
from dapple.models import EmulatedNet
from dapple.planner import Stage
from dapple.profiler import trace_layers

S = 4
LAYERS = 2 * S  # two emulated layers per rank, then the head on the last
DAPPLE = (("dapple/A", "dapple", "A"), ("dapple/B", "dapple", "B"), ("dapple/gpipe", "gpipe", "A"),
          ("dapple/zb-h1", "zb-h1", "A"), ("dapple/interleaved-1f1b", "interleaved-1f1b", "A"),
          ("dapple/zb-v", "zb-v", "A"))
CHUNKED = {"interleaved-1f1b": "loop", "zb-v": "v"}  # dapple's schedules of two chunks per rank: their placement
PAIRS = (("dapple/interleaved-1f1b", "pippy/Interleaved1F1B"), ("dapple/zb-v", "pippy/ZBV"))  # same placement


def _model(ms: float, width: int) -> EmulatedNet:
    torch.manual_seed(0)
    return EmulatedNet([ms / 2] * LAYERS, width=width, weight_share=0.5)


def _rank_of(stage: int, kind: str) -> int:
    """The rank of two-chunk stage ``stage`` (one layer each): loop (r, r + S) or V (r, 2S - 1 - r)."""
    return stage % S if kind == "loop" or stage < S else 2 * S - 1 - stage


def _plan(model: EmulatedNet, b: int, m: int, schedule: str, policy: str) -> dapple.Plan:
    if schedule in CHUNKED:  # one layer a stage, two stages a rank; the head with the last
        stages = [Stage((i, i + 1 + (i == LAYERS - 1)), [_rank_of(i, CHUNKED[schedule])]) for i in range(LAYERS)]
    else:
        stages = [Stage((2 * i, 2 * i + 2 + (i == S - 1)), [i]) for i in range(S)]  # the head with the last stage
    return dapple.Plan(global_batch_size=b * m, micro_batch_size=b, schedule=schedule, warmup_policy=policy,
                       stages=stages, layer_names=trace_layers(model).names)


def _pippy_stages(model: EmulatedNet, rank: int, kind: str) -> list[tuple[int, nn.Module]]:
    """(stage index, module) of this rank: one stage of two layers ("single"), or two stages of one layer,
    interleaved ("loop": layers r, r + S) or V-shaped ("v": layers r, 2S - 1 - r); the head after the last layer."""
    def mod(layers: list[int]) -> nn.Module:
        mods = [model.layers[i] for i in layers]
        return nn.Sequential(*mods, model.head) if LAYERS - 1 in layers else nn.Sequential(*mods)
    if kind == "single":
        return [(rank, mod([2 * rank, 2 * rank + 1]))]
    return [(i, mod([i])) for i in range(LAYERS) if _rank_of(i, kind) == rank]


def _pippy_engines() -> tuple:
    from torch.distributed import pipelining as pp
    engines = [("pippy/1F1B", "single", pp.Schedule1F1B), ("pippy/GPipe", "single", pp.ScheduleGPipe),
               ("pippy/Interleaved1F1B", "loop", pp.ScheduleInterleaved1F1B),
               ("pippy/InterleavedZB", "loop", pp.ScheduleInterleavedZeroBubble),
               ("pippy/ZBV", "v", pp.ScheduleZBVZeroBubble)]
    if hasattr(pp, "ScheduleDualPipeV"):
        engines.append(("pippy/DualPipeV", "v", pp.ScheduleDualPipeV))
    return pp.PipelineStage, tuple(engines)


def _pippy_step(args: argparse.Namespace, kind: str, cls, stage_cls, x, y):
    """A step function of PiPPy schedule ``cls`` on this rank's stages."""
    rank, m = dist.get_rank(), args.micro_batches
    model = _model(args.ms_per_row, args.width)
    mine = _pippy_stages(model, rank, kind)
    n = S if kind == "single" else 2 * S
    stages = [stage_cls(mod, i, n, torch.device("cpu")) for i, mod in mine]
    sched = cls(stages[0] if kind == "single" else stages, n_microbatches=m, loss_fn=F.cross_entropy)
    first, last = any(i == 0 for i, _ in mine), any(i == n - 1 for i, _ in mine)

    def step() -> None:
        kw = {"target": y} if last else {}
        sched.step(*((x,) if first else ()), **kw)
    order = getattr(sched, "pipeline_order", None) or {}
    step.actions = {r: [str(a) for a in acts if a is not None] for r, acts in order.items()}  # for replay()
    return step


def run(args: argparse.Namespace) -> dict:
    """Build every engine, warm each up, then time them in interleaved rounds (load drifts hit all alike)."""
    torch.set_num_threads(1)
    b, m = args.micro_batch, args.micro_batches
    gen = torch.Generator().manual_seed(1)  # the same global batch on every rank
    x = torch.randn(b * m, args.width, generator=gen)
    y = torch.randint(0, 4, (b * m,), generator=gen)
    steps, pipes = {}, {}
    keep = re.compile(args.engines)
    for name, schedule, policy in DAPPLE:
        if not keep.search(name) and name not in ("dapple/A", "dapple/zb-h1"):  # the table's references
            continue
        model = _model(args.ms_per_row, args.width)
        pipe = dapple.pipeline(model, _plan(model, b, m, schedule, policy), F.cross_entropy, timeout=120,
                               check_inputs=not args.no_check_inputs)
        steps[name] = lambda pipe=pipe: pipe.train_step(x, y)
        pipes[name] = pipe
    stage_cls, engines = _pippy_engines()
    for name, kind, cls in engines:
        if not keep.search(name):
            continue
        try:
            steps[name] = _pippy_step(args, kind, cls, stage_cls, x, y)
        except Exception as e:  # a schedule this torch cannot build for these stages: reported, not timed
            print(f"rank {dist.get_rank()}: {name} skipped: {type(e).__name__}: {e}", flush=True)
    for step in steps.values():
        timed_steps(step, args.warmup)
    results: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            results[name] += [w for w, _ in timed_steps(step, args.steps)]
    actions = {name: getattr(step, "actions", None) for name, step in steps.items()}
    return {"step_ms": results, "op_ms": _op_durations(pipes["dapple/A"], steps["dapple/A"], args.steps),
            "actions": {name: a for name, a in actions.items() if a}}


def simulated(args: argparse.Namespace) -> dict[str, float]:
    """Simulated step ms of each dapple schedule on the nominal costs (no transfer time)."""
    from dapple.core.cluster import Cluster
    from dapple.core.profile import LayerProfile, Profile
    from dapple.planner import simulate
    b, m, ms = args.micro_batch, args.micro_batches, args.ms_per_row
    model = _model(ms, args.width)
    names = trace_layers(model).names
    layers = [LayerProfile(n, [b * ms / 2 if n != "head" else 0.0], [b * ms if n != "head" else 0.0], [0.0], [0.0],
                           0) for n in names]
    prof = Profile("emulated", "nominal", [b], layers)
    cluster = Cluster(1, S, 1e30, 1e30, 0.0, 0.0, 1e12, name="emulated")
    return {name: simulate(_plan(model, b, m, sch, pol), prof, cluster).latency_ms for name, sch, pol in DAPPLE}


ACTION = re.compile(r"(\d+)([FIWB])(\d+)")  # PiPPy's compute actions: stage, kind, micro-batch ("3I5")


def _waits_for(s: int, k: str, m: int, last: int) -> list[tuple]:
    """The actions (stage, kind, micro-batch) one of which PiPPy's action (s, k, m) waits for."""
    if k == "F":
        return [(s - 1, "F", m)] if s > 0 else []
    if k in "IB":  # input gradients come from the stage below; the last stage's from its own forward
        return [(s, "F", m)] if s == last else [(s + 1, "I", m), (s + 1, "B", m)]
    return [(s, "I", m)]  # W after its own I


def replay(actions: dict[int, list[str]], chunk_ms: float) -> float:
    """Step ms of PiPPy's own per-rank action lists played with nominal durations and free transfers: each
    rank runs its list in order, an action waiting for :func:`_waits_for`; F, I and W of one chunk take
    ``chunk_ms``, a full B twice that (OVERLAP_F_B runs its parts in a row)."""
    todo = {r: [(int(s), k, int(m)) for a in acts for s, k, m in ACTION.findall(a)] for r, acts in actions.items()}
    last = max(s for acts in todo.values() for s, _, _ in acts)
    done: dict[tuple, float] = {}
    free = {r: 0.0 for r in todo}
    while any(todo.values()):
        moved = False
        for r, acts in todo.items():
            while acts:
                needs = _waits_for(*acts[0], last)
                ready = [done[n] for n in needs if n in done]
                if needs and not ready:
                    break
                start = max([free[r]] + ready)
                free[r] = done[acts[0]] = start + chunk_ms * (2 if acts[0][1] == "B" else 1)
                acts.pop(0)
                moved = True
        if not moved:
            raise RuntimeError(f"replay: PiPPy's action lists wait on each other: {todo}")
    return max(free.values())


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
    p.add_argument("--engines", default=".", help="a regular expression: only the engines it matches (besides "
                   "dapple/A and dapple/zb-h1, the references)")
    p.add_argument("--json", help="also write the raw step times here")
    p.add_argument("--no-check-inputs", action="store_true", help="dapple without its per-step input checks")
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
          f"(half weight gradients) ideal 1F1B step={ideal:.1f} ms; {args.rounds} interleaved rounds x "
          f"{args.steps} steps, medians")
    print("measured op medians per stage (ms): " + ", ".join(f"{r}: F'={d['F']:.2f} B'={d['B']:.2f}"
                                                              for r, d in ops.items()))
    print(f"ideal from measured ops (M + S - 1)(F' + B') = {ideal_ops:.1f} ms")
    med = {name: statistics.median(ts) for name, ts in res.items()}
    zb = med["dapple/zb-h1"]
    print(f"{'engine':<24}{'median ms':>10}{'min ms':>9}{'efficiency':>12}{'vs ops':>9}{'ZB / it':>9}")
    for name, ts in res.items():
        print(f"{name:<24}{med[name]:>10.1f}{min(ts):>9.1f}{ideal / med[name]:>12.3f}{ideal_ops / med[name]:>9.3f}"
              f"{med[name] / zb:>9.3f}")
    sim = simulated(args)
    kinds = {name: kind for name, kind, _ in _pippy_engines()[1]}
    for name, acts in got["actions"].items():  # two-chunk schedules (one layer a chunk); 1F1B/GPipe: dapple's
        if kinds.get(name) != "single":
            sim[name] = replay(acts, f / 2)
    print("simulated (nominal costs, no transfer time; PiPPy: its own action lists, replay()):")
    for name, t in sim.items():
        print(f"  {name:<24}{t:>8.1f} ms   ZB / it {t / sim['dapple/zb-h1']:.3f}")
    print("dapple / PiPPy on the same two chunks per rank (median step ratio; simulated):")
    for mine, theirs in PAIRS:
        if theirs in med and mine in med:
            simmed = f"   ({sim[mine] / sim[theirs]:.3f})" if theirs in sim else ""
            print(f"  {mine:<24} / {theirs:<22} {med[mine] / med[theirs]:.3f}{simmed}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "ideal_ms": ideal, "ideal_ops_ms": ideal_ops, "op_ms": ops, "step_ms": res,
                       "simulated_ms": sim}, fh, indent=1)


if __name__ == "__main__":
    main()
