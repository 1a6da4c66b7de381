"""Cost of deferred_batch_norm=True: step time with and without it, built-in ResNet on 2 ranks (gloo, CPU).

Two pipelines over copies of one model (deferred and not) are timed in interleaved rounds; the ratio is the
median over rounds of (deferred median step / plain median step in the same round). Plans: the whole model
replicated on both ranks (one AllReduce of BatchNorm statistics per step over 2 ranks), and 2 stages.

    PYTHONPATH=$PWD python benchmarks/deferred_batchnorm.py
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics

import torch
import torch.nn.functional as F
from _timing import timed_steps  # benchmarks/_timing.py

import dapple
from dapple.models import ResNet
from dapple.planner import Stage
from dapple.profiler import trace_layers


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = ResNet(widths=tuple(args.widths), depth=args.depth)
    names = trace_layers(base).names
    half = len(names) // 2
    g = args.micro_batch * args.micro_batches
    x, y = torch.randn(g, 3, args.image, args.image), torch.randint(0, 10, (g,))
    layouts = {"replicated (1 stage x 2)": [Stage((0, len(names)), [0, 1])],
               "2 stages": [Stage((0, half), [0]), Stage((half, len(names)), [1])]}
    out: dict[str, dict[bool, list[list[float]]]] = {}
    for label, stages in layouts.items():
        plan = dapple.Plan(g, args.micro_batch, stages, layer_names=names)
        steps = {}
        for deferred in (False, True):
            pipe = dapple.pipeline(copy.deepcopy(base), plan, F.cross_entropy, timeout=300,
                                   deferred_batch_norm=deferred)
            steps[deferred] = (lambda pipe=pipe: pipe.train_step(x, y),
                               lambda pipe=pipe: [setattr(p, "grad", None) for p in pipe.parameters()])
        for step, drop in steps.values():  # warm up (shape inference, allocator)
            timed_steps(step, args.warmup, before=drop)
        out[label] = {d: [] for d in steps}
        for _ in range(args.rounds):
            for d, (step, drop) in steps.items():
                out[label][d].append([w for w, _ in timed_steps(step, args.steps, before=drop)])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--image", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = dapple.runtime.launch(run, 2, args)[0]
    print(f"ResNet widths={args.widths} depth={args.depth} image {args.image}, micro-batch {args.micro_batch} x "
          f"{args.micro_batches}; {args.rounds} interleaved rounds x {args.steps} steps")
    for label, r in res.items():
        ratio = statistics.median(statistics.median(a) / statistics.median(b) for a, b in zip(r[True], r[False]))
        plain = statistics.median(w for rnd in r[False] for w in rnd)
        print(f"  {label:<26} plain median {plain:7.1f} ms   deferred / plain {ratio:.3f}")


if __name__ == "__main__":
    main()
