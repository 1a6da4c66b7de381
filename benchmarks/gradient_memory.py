"""What a replicated stage holds for its gradients: process peak of training steps against the parameters' bytes.

One stage replicated on 2 ranks (pure data parallelism, so every parameter is AllReduced), an MLP of ``--layers``
linear layers of ``--width``, SGD with ``zero_grad()`` between steps. Per rank: the process peak while building the
pipeline and training over the memory held once the model is built (RSS high-water mark, reset through
/proc/self/clear_refs), in units of the stage's parameter bytes: the gradients themselves are 1.0 of it; a copy of
them for the AllReduce adds another 1.0. The ranks run with ``MALLOC_MMAP_THRESHOLD_=65536`` (unless set): glibc then
returns every freed block over 64 KiB to the system, so the peak is what was held at once, not what the allocator
kept from earlier allocations.

    PYTHONPATH=$PWD python benchmarks/gradient_memory.py
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from _memory import rss  # benchmarks/_memory.py
from torch import nn

import dapple
from dapple.planner import Stage
from dapple.profiler import trace_layers


def run(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    names = trace_layers(model).names
    plan = dapple.Plan(global_batch_size=2 * args.rows, micro_batch_size=2 * args.rows,
                       stages=[Stage((0, len(names)), [0, 1])], layer_names=names)
    x, y = torch.randn(2 * args.rows, args.width), torch.randn(2 * args.rows, args.width)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts from the current RSS
    base, _ = rss()
    pipe = dapple.pipeline(model, plan, F.mse_loss, timeout=600, reduce_dtype=args.reduce_dtype)
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    for _ in range(args.steps):
        pipe.train_step(x, y)
        opt.step()
        opt.zero_grad()
    return {"params": params, "peak": rss()[1] - base}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", type=int, default=8, help="rows per rank (small: the activations stay negligible)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--reduce-dtype", choices=("bf16", "fp16", "fp32"), default=None)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # (read by each rank's allocator at its start)
    res = dapple.runtime.launch(run, 2, args)
    params = res[0]["params"]
    print(f"MLP {args.layers} x {args.width}: {params / 2**20:.1f} MiB of parameters per rank, one stage on 2 ranks, "
          f"{args.steps} steps, reduce_dtype={args.reduce_dtype}")
    for r, v in sorted(res.items()):
        print(f"rank {r}: peak over the memory with the model built {v['peak'] / 2**20:.1f} MiB = "
              f"{v['peak'] / params:.2f} x the parameters")


if __name__ == "__main__":
    main()
