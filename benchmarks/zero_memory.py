"""ZeRO-1 (dapple.shard_optimizer): the optimizer state each replica of a stage holds, sharded against unsharded.

One stage replicated on ``--nproc`` ranks (pure data parallelism), or ``--stages`` stages each on nproc / stages of
them; an MLP of ``--layers`` linear layers of ``--width``; AdamW (two moments per parameter). Each mode trains
``--steps`` steps from the same start, first with ``torch.optim.AdamW`` and then with ``dapple.shard_optimizer(pipe,
torch.optim.AdamW)``. Per rank: the bytes of optimizer state it holds (its tensors), and the process peak while
building and training over the memory held once the model is built (RSS high-water mark, reset through
/proc/self/clear_refs), both in units of the stage's parameter bytes: gradients are 1.0 of them, unsharded Adam's
state 2.0, sharded over r replicas 2 / r (what ``dapple.plan(..., shard_optimizer=True)`` prices). Also the median
step time (train_step + optimizer step), sharded over unsharded, and whether the two ended with the same
parameters. The ranks run with ``MALLOC_MMAP_THRESHOLD_=65536`` (unless set), so freed blocks go back to the system.

    PYTHONPATH=$PWD python benchmarks/zero_memory.py
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time

import torch
import torch.nn.functional as F
from _memory import rss  # benchmarks/_memory.py
from torch import nn

import dapple
from dapple.planner import Stage
from dapple.profiler import trace_layers


def _plan(names: list[str], nproc: int, stages: int, rows: int) -> dapple.Plan:
    per, layers = nproc // stages, len(names)
    cuts = [layers * i // stages for i in range(stages + 1)]
    return dapple.Plan(global_batch_size=per * rows, micro_batch_size=per * rows, layer_names=names,
                       stages=[Stage((cuts[i], cuts[i + 1]), list(range(i * per, (i + 1) * per)))
                               for i in range(stages)])


def run(args: argparse.Namespace, sharded: bool) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    plan = _plan(trace_layers(model).names, args.nproc, args.stages, args.rows)
    x, y = torch.randn(plan.global_batch_size, args.width), torch.randn(plan.global_batch_size, args.width)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts from the current RSS
    base, _ = rss()
    pipe = dapple.pipeline(model, plan, F.mse_loss, timeout=600)
    params = sum(p.numel() * p.element_size() for p in pipe.parameters())
    opt = dapple.shard_optimizer(pipe, torch.optim.AdamW, lr=1e-3) if sharded else \
        torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        pipe.train_step(x, y)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    state = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor))
    return {"params": params, "state": state, "peak": rss()[1] - base, "stage": pipe.stage,
            "step_s": statistics.median(times[1:]), "end": _digest(pipe.parameters())}


def _digest(params) -> str:
    """A hash of the parameters' bytes (the two modes compare it)."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", type=int, default=4, help="rows per replica (small: the activations stay negligible)")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    if args.nproc % args.stages:
        p.error(f"--nproc {args.nproc} is not a multiple of --stages {args.stages}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # (read by each rank's allocator at its start)
    res = {mode: dapple.runtime.launch(run, args.nproc, args, mode) for mode in (False, True)}
    r = args.nproc // args.stages
    print(f"MLP {args.layers} x {args.width}, {args.stages} stage(s) x {r} replicas on {args.nproc} processes, AdamW, "
          f"{args.steps} steps (units: the rank's stage parameter bytes)")
    print(f"{'rank':>4} {'stage':>5} {'params MiB':>10} {'state unsharded':>15} {'state sharded':>13} "
          f"{'peak unsharded':>14} {'peak sharded':>12} {'step time ratio':>15} {'same':>5}")
    for rank in sorted(res[False]):
        a, b = res[False][rank], res[True][rank]
        same = a["end"] == b["end"]
        print(f"{rank:>4} {a['stage']:>5} {a['params'] / 2**20:>10.1f} {a['state'] / a['params']:>15.3f} "
              f"{b['state'] / b['params']:>13.3f} {a['peak'] / a['params']:>14.2f} {b['peak'] / b['params']:>12.2f} "
              f"{b['step_s'] / a['step_s']:>15.2f} {str(same):>5}")
    print(f"planner's static bytes per parameter byte (optimizer_factor 4): unsharded 4.0, sharded over {r}: "
          f"{2 + 2 / r:.3f}")


if __name__ == "__main__":
    main()
