"""Real-compute step time on 2 ranks: dapple vs torch.distributed.pipelining, same GPT stages and micro-batches.

Two processes on this machine share about one core of matmul throughput, so only the ratio to PiPPy on the
same configuration means something. Engines are measured in interleaved rounds (every round times each
engine for ``--steps`` steps) to spread the machine's load over all of them; a ratio is the median over
rounds of (this engine's median step / PiPPy 1F1B's median step in the same round). Besides wall time,
the CPU time of both processes together is reported: with one core of throughput the step cannot be
shorter than it, and it is much less disturbed by other load on the machine than wall time.

    PYTHONPATH=$PWD python benchmarks/real_compute.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
from _timing import timed_steps  # benchmarks/_timing.py
from torch import nn

import dapple
from dapple.models import GPT, lm_loss, random_tokens
from dapple.planner import Stage
from dapple.profiler import trace_layers


class Front(nn.Module):
    """PiPPy stage 0: embeddings and the first ``k`` blocks of ``gpt``. idx (B, T) -> (B, T, C)."""

    def __init__(self, gpt: GPT, k: int):
        super().__init__()
        self.wte, self.wpe, self.drop, self.blocks = gpt.wte, gpt.wpe, gpt.drop, gpt.blocks[:k]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device)))
        for b in self.blocks:
            x = b(x)
        return x


class Back(nn.Module):
    """PiPPy stage 1: the remaining blocks, final norm and head. (B, T, C) -> logits (B, T, V)."""

    def __init__(self, gpt: GPT, k: int):
        super().__init__()
        self.blocks, self.ln_f, self.lm_head = gpt.blocks[k:], gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def _gpt(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd,
               tie_weights=False)  # PiPPy cannot share a parameter between stages


def run(args: argparse.Namespace) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    torch.set_num_threads(1)
    g, b = args.micro_batch * args.micro_batches, args.micro_batch
    x, y = random_tokens(g, args.seq, args.vocab, generator=torch.Generator().manual_seed(0))
    k = args.layers // 2
    steps: dict[str, object] = {}

    model = _gpt(args)
    names = trace_layers(model).names
    cut = names.index(f"blocks.{k}")
    plan = dapple.Plan(global_batch_size=g, micro_batch_size=b, stages=[Stage((0, cut), [0]),
                       Stage((cut, len(names)), [1])], layer_names=names)
    pipe = dapple.pipeline(model, plan, lm_loss, timeout=300)
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)

    def dapple_step() -> None:
        pipe.train_step(x, y)
        opt.step()
        opt.zero_grad()
    steps["dapple"] = dapple_step

    rank = dist.get_rank()
    for name, cls in (("pippy/1F1B", Schedule1F1B), ("pippy/GPipe", ScheduleGPipe)):
        gpt = _gpt(args)
        mod = Front(gpt, k) if rank == 0 else Back(gpt, k)
        sched = cls(PipelineStage(mod, rank, 2, torch.device("cpu")), n_microbatches=args.micro_batches,
                    loss_fn=lm_loss)
        popt = torch.optim.SGD(mod.parameters(), lr=1e-3)

        def pippy_step(sched=sched, popt=popt) -> None:
            if rank == 0:
                sched.step(x)
            else:
                sched.step(target=y)
            popt.step()
            popt.zero_grad()
        steps[name] = pippy_step

    for step in steps.values():  # warm up every engine (first-step shape inference, allocator)
        timed_steps(step, args.warmup)
    results: dict[str, list[list[tuple[float, float]]]] = {name: [] for name in steps}  # per round, per step
    for _ in range(args.rounds):
        for name, step in steps.items():
            results[name].append(timed_steps(step, args.steps))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", help="also write the raw step times here")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = dapple.runtime.launch(run, 2, args)[0]
    base = "pippy/1F1B"
    print(f"GPT layers={args.layers} embd={args.embd} seq={args.seq}, 2 stages, M={args.micro_batches} "
          f"micro-batch={args.micro_batch}; {args.rounds} interleaved rounds x {args.steps} steps")
    print(f"{'engine':<14}{'wall ms':>9}{'min':>8}{'wall ratio':>12}{'CPU ms':>9}{'CPU ratio':>11}   (ratios: paired "
          f"per round, vs {base})")
    for name, rounds in res.items():
        # paired: per round, this engine's median over PiPPy 1F1B's median in the same round (load drifts cancel)
        walls = [[w for w, _ in r] for r in rounds]
        cpus = [[c for _, c in r] for r in rounds]
        wall_ratio = statistics.median(statistics.median(a) / statistics.median([w for w, _ in b])
                                       for a, b in zip(walls, res[base]))
        cpu_ratio = statistics.median(statistics.median(a) / statistics.median([c for _, c in b])
                                      for a, b in zip(cpus, res[base]))
        flat_w, flat_c = [w for r in walls for w in r], [c for r in cpus for c in r]
        print(f"{name:<14}{statistics.median(flat_w):>9.1f}{min(flat_w):>8.1f}{wall_ratio:>12.3f}"
              f"{statistics.median(flat_c):>9.1f}{cpu_ratio:>11.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "step_ms": res}, fh, indent=1)


if __name__ == "__main__":
    main()
