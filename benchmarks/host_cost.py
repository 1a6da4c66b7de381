"""Host cost per op: dapple's 1F1B against torch.distributed.pipelining's Schedule1F1B on the same stages, with
layers that take no time, so a step is only what the engines do around the ops.

4 straight stages, one rank each, two zero-time emulated layers per stage (the head on the last), M micro-batches.
Per engine: the median step (wall, the slowest rank) and the CPU time per compute op (process CPU time of a step
summed over the ranks, divided by the step's 2 x M x S forward and backward ops). With ``--profile DIR`` rank 0
also writes a cProfile of dapple's steps to DIR/dapple_rank0.prof (``python -m pstats``).

    PYTHONPATH=$PWD python benchmarks/host_cost.py --micro-batches 16 --steps 20
    PYTHONPATH=$PWD python benchmarks/host_cost.py --separate --clock thread   # each engine alone; main thread
"""

from __future__ import annotations

import argparse
import cProfile
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _timing import timed_steps  # benchmarks/_timing.py

import dapple
from dapple.models import EmulatedNet
from dapple.planner import Stage
from dapple.profiler import trace_layers

S = 4


def _model(width: int) -> EmulatedNet:
    torch.manual_seed(0)
    return EmulatedNet([0.0] * (2 * S), width=width)


def _dapple_step(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor):
    model = _model(args.width)
    stages = [Stage((2 * i, 2 * i + 2 + (i == S - 1)), [i]) for i in range(S)]
    plan = dapple.Plan(global_batch_size=len(x), micro_batch_size=args.micro_batch, stages=stages,
                       layer_names=trace_layers(model).names)
    pipe = dapple.pipeline(model, plan, F.cross_entropy, timeout=120, check_inputs=not args.no_check_inputs)
    return lambda: pipe.train_step(x, y)


def _pippy_step(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor):
    from torch.distributed import pipelining as pp
    rank, model = dist.get_rank(), _model(args.width)
    layers = [model.layers[2 * rank], model.layers[2 * rank + 1]] + ([model.head] if rank == S - 1 else [])
    stage = pp.PipelineStage(torch.nn.Sequential(*layers), rank, S, torch.device("cpu"))
    sched = pp.Schedule1F1B(stage, n_microbatches=args.micro_batches, loss_fn=F.cross_entropy)

    def step() -> None:
        sched.step(*((x,) if rank == 0 else ()), **({"target": y} if rank == S - 1 else {}))
    return step


ENGINES = {"dapple 1F1B": _dapple_step, "PiPPy Schedule1F1B": _pippy_step}


def run(args: argparse.Namespace, only: str | None = None) -> dict[str, list[tuple[float, float]]]:
    """Time both engines in interleaved rounds in these processes, or ``only`` that one."""
    torch.set_num_threads(1)
    if not dist.is_initialized():  # (dapple.pipeline joins the group itself; PiPPy alone needs it)
        dist.init_process_group("gloo")
    m, b = args.micro_batches, args.micro_batch
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(b * m, args.width, generator=gen), torch.randint(0, 4, (b * m,), generator=gen)
    steps = {name: make(args, x, y) for name, make in ENGINES.items() if only in (None, name)}
    clock = time.thread_time if args.clock == "thread" else time.process_time
    for step in steps.values():
        timed_steps(step, 3)
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for _ in range(args.rounds):  # interleaved rounds: load drifts hit both alike
        for name, step in steps.items():
            out[name] += timed_steps(step, args.steps, clock)
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(lambda: [steps["dapple 1F1B"]() for _ in range(args.steps)])
        if dist.get_rank() == 0:
            os.makedirs(args.profile, exist_ok=True)
            prof.dump_stats(os.path.join(args.profile, "dapple_rank0.prof"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batches", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--steps", type=int, default=10, help="timed steps per round and engine")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-check-inputs", action="store_true", help="dapple.pipeline(..., check_inputs=False)")
    p.add_argument("--profile", help="also write a cProfile of rank 0's dapple steps into this directory")
    p.add_argument("--separate", action="store_true",
                   help="each engine in processes of its own (only its process groups), one after the other")
    p.add_argument("--clock", choices=("process", "thread"), default="process",
                   help="CPU time of the whole process (its gloo threads too) or of the main thread only")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.separate:
        res = {name: dapple.runtime.launch(run, S, args, name)[0][name] for name in ENGINES}
    else:
        res = dapple.runtime.launch(run, S, args)[0]
    ops = 2 * args.micro_batches * S
    print(f"{S} stages x 2 zero-time layers, M = {args.micro_batches} of {args.micro_batch} rows, "
          f"{args.rounds} x {args.steps} steps per engine ({'separate processes' if args.separate else 'interleaved'});"
          f" CPU per op: a step's {args.clock} CPU over all ranks / {ops} F and B ops")
    print(f"{'engine':<20}{'median step ms':>16}{'CPU ms per op':>15}")
    med = {}
    for name, runs in res.items():
        med[name] = (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs) / ops)
        print(f"{name:<20}{med[name][0]:>16.2f}{med[name][1]:>15.3f}")
    d, q = med["dapple 1F1B"], med["PiPPy Schedule1F1B"]
    print(f"dapple / PiPPy: step {d[0] / q[0]:.3f}x, CPU per op {d[1] / q[1]:.3f}x")


if __name__ == "__main__":
    main()
