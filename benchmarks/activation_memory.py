"""Peak activation memory per stage at a fixed micro-batch size: dapple (early backward) vs gpipe, M = 4..32.

What is measured: the bytes of the tensors autograd saves for backward and holds at once (the activations
a stage keeps alive between a micro-batch's forward and its backward), via
``dapple.runtime.ActivationMeter`` (saved-tensor hooks) around ``train_step``; parameters are excluded, a view counts
its own bytes, a tensor saved twice counts once. The CPU allocator has no peak statistics, and this is the
quantity early backward bounds (paper Table 5: dapple's peak stays flat in M, gpipe's grows with M).

    PYTHONPATH=$PWD python benchmarks/activation_memory.py
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import dapple
from dapple.models import GPT, lm_loss, random_tokens
from dapple.planner import Stage
from dapple.profiler import trace_layers

S = 4


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    out: dict[str, int] = {}
    for m in args.micro_batches:
        for schedule in ("dapple", "gpipe"):
            torch.manual_seed(0)
            model = GPT(vocab_size=args.vocab, block_size=args.seq, n_layer=S, n_head=4, n_embd=args.embd)
            names = trace_layers(model).names
            first, last = names.index("blocks.1"), names.index("blocks.3")
            stages = [Stage((0, first), [0]), Stage((first, first + 1), [1]), Stage((first + 1, last), [2]),
                      Stage((last, len(names)), [3])]
            g = args.micro_batch * m
            plan = dapple.Plan(global_batch_size=g, micro_batch_size=args.micro_batch, schedule=schedule,
                               stages=stages, layer_names=names)
            pipe = dapple.pipeline(model, plan, lm_loss, timeout=300)
            x, y = random_tokens(g, args.seq, args.vocab, generator=torch.Generator().manual_seed(0))
            pipe.train_step(x, y)  # first step: shapes, buffers
            with dapple.runtime.ActivationMeter(pipe.parameters()) as meter:
                pipe.train_step(x, y)
            out[f"{schedule}/{m}"] = meter.peak
            dist.barrier()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--json", help="also write the raw peaks here")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = dapple.runtime.launch(run, S, args)
    print(f"GPT 4 blocks, one per stage on 4 ranks, micro-batch {args.micro_batch} x seq {args.seq}; peak saved "
          f"activations per stage (KiB)")
    print(f"{'schedule/M':<14}" + "".join(f"{'stage ' + str(s):>10}" for s in range(S)) + f"{'max':>10}")
    for key in res[0]:
        row = [res[r][key] / 1024 for r in range(S)]
        print(f"{key:<14}" + "".join(f"{v:>10.0f}" for v in row) + f"{max(row):>10.0f}")
    d = {m: max(res[r][f"dapple/{m}"] for r in range(S)) for m in args.micro_batches}
    gp = {m: max(res[r][f"gpipe/{m}"] for r in range(S)) for m in args.micro_batches}
    lo, hi = min(args.micro_batches), max(args.micro_batches)
    print(f"dapple M={hi} vs M={lo}: {d[hi] / d[lo]:.3f}x; dapple vs gpipe at M={hi}: {d[hi] / gp[hi]:.3f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "peak_bytes": {r: res[r] for r in range(S)}}, fh, indent=1)


if __name__ == "__main__":
    main()
