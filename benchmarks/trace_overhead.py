"""Cost of runtime tracing: step time with tracing off vs on, on 2 ranks, steps interleaved one by one.

The worst case for a per-op recorder: a tiny real-compute model (Linear+tanh blocks, width 16) in 2 straight
stages with many one-row micro-batches, so a step is mostly runtime overhead (about 5 events per micro-batch
per rank). Both pipelines live in the same processes and alternate step by step (each first in turn), so each
traced step is paired with an untraced one a few ms apart and drifts in the machine's load hit both alike.
Wall time = the slowest rank's, all ranks starting together; CPU = the main thread's, mean over ranks.

    PYTHONPATH=$PWD python benchmarks/trace_overhead.py                  # off vs on
    mkdir -p /tmp/main_src && git archive main | tar -x -C /tmp/main_src   # a checkout without tracing code:
    PYTHONPATH=$PWD python benchmarks/trace_overhead.py --baseline /tmp/main_src/dapple   # it too, same processes

Tracing "off" costs one ``is None`` test per instruction; its price is also measured directly (``--micro``).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import statistics
import sys
import time
import timeit

import torch
import torch.nn.functional as F
from _timing import timed_steps  # benchmarks/_timing.py
from torch import nn

import dapple
from dapple.profiler import trace_layers


class Blocks(nn.Module):
    """``depth`` Linear+tanh blocks then a head: x (B, width) -> (B, 4)."""

    def __init__(self, depth: int = 4, width: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _baseline(path: str):
    """The dapple package at ``path`` (another checkout), imported as ``dapple_baseline`` beside this one."""
    spec = importlib.util.spec_from_file_location("dapple_baseline", os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules["dapple_baseline"] = module
    spec.loader.exec_module(module)
    return module


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    m = args.micro_batches
    x, y = torch.randn(m, 16), torch.randint(0, 4, (m,))
    can_trace = "trace" in inspect.signature(dapple.pipeline).parameters
    modes = {"off": (dapple, False), "on": (dapple, True)} if can_trace else {"off (no tracing code)": (dapple, None)}
    if args.baseline:
        modes["baseline"] = (_baseline(args.baseline), None)
    steps = {}
    for name, (lib, on) in modes.items():
        torch.manual_seed(0)
        model = Blocks()
        plan = lib.Plan(global_batch_size=m, micro_batch_size=1, stages=[((0, 2), [0]), ((2, 5), [1])],
                        layer_names=trace_layers(model).names)
        kw = {} if on is None else {"trace": on}
        pipe = lib.pipeline(model, plan, F.cross_entropy, timeout=120, **kw)
        steps[name] = lambda pipe=pipe: pipe.train_step(x, y)
    for step in steps.values():
        timed_steps(step, args.warmup, time.thread_time, "mean")
    res: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    names = list(steps)
    for i in range(args.rounds * args.steps):  # step by step, each mode first in turn (no position bias)
        for name in names[i % len(names):] + names[:i % len(names)]:
            res[name] += timed_steps(steps[name], 1, time.thread_time, "mean")
    return res


def micro() -> dict[str, float]:
    """ns per tracing-off test (the engine's pattern) and per recorded event (clock reads + Event)."""
    from dapple.runtime.tracing import Recorder
    rec = None
    n = 1_000_000
    off = timeit.timeit("start = rec.clock() if rec is not None else 0.0", globals={"rec": rec}, number=n)
    empty = timeit.timeit("start = 0.0", number=n)
    r = Recorder(0, 0)
    r.begin_step(1)
    on = timeit.timeit("s = r.clock(); r.compute('F', 3, s, r.clock())", globals={"r": r}, number=100_000)
    return {"off_test_ns": (off - empty) / n * 1e9, "event_ns": on / 100_000 * 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batches", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro", action="store_true", help="also time the off-test and one event in isolation")
    p.add_argument("--baseline", help="also run the dapple package in this directory (e.g. main's, without "
                   "tracing code), in the same processes")
    p.add_argument("--json", help="also write the raw step times here")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = dapple.runtime.launch(run, 2, args)[0]
    print(f"2 straight stages, M={args.micro_batches} one-row micro-batches, {args.rounds} interleaved rounds x "
          f"{args.steps} steps; per step: wall ms (slowest rank), main-thread CPU ms (mean over ranks)")
    first = next(iter(res.values()))
    wall0, cpu0 = statistics.median(w for w, _ in first), statistics.median(c for _, c in first)
    for name, ts in res.items():
        wall, cpu = statistics.median(w for w, _ in ts), statistics.median(c for _, c in ts)
        dwall = statistics.median(w - w0 for (w, _), (w0, _) in zip(ts, first))  # paired: consecutive steps
        dcpu = statistics.median(c - c0 for (_, c), (_, c0) in zip(ts, first))
        print(f"  tracing {name:<22} wall median {wall:7.2f} min {min(w for w, _ in ts):6.2f} | CPU median "
              f"{cpu:6.2f} | paired median difference: wall {1e3 * dwall:+5.0f} us ({dwall / wall0:+.1%}), "
              f"CPU {1e3 * dcpu:+5.0f} us ({dcpu / cpu0:+.1%})")
    if args.micro:
        for k, v in micro().items():
            print(f"  {k}: {v:.0f} ns")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "step_ms": res}, fh, indent=1)


if __name__ == "__main__":
    main()
