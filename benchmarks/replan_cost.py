"""What switching plans costs: ``pipe.replan`` in memory against a checkpoint saved and loaded under the new plan.

The built-in GPT (``--layers`` blocks of width ``--embd``, tied embedding) with AdamW state trains on 4 local ranks
(gloo) and switches between two plans, ``--rounds`` times each way: by ``pipe.replan(plan, opt)`` (this rank's
stage of the new plan built from the model's skeleton, state moved point to point), and as a restart would
(``dapple.save_checkpoint``, a new pipeline and optimizer under the other plan, ``dapple.load_checkpoint``). A
switch's time is the slowest rank's; bytes are the state that changed ranks (sent by all ranks). One train step
follows each switch, so both paths pay their first step.

    PYTHONPATH=$PWD python benchmarks/replan_cost.py
    PYTHONPATH=$PWD python benchmarks/replan_cost.py --layers 8 --embd 256 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import dapple
from dapple.models import GPT, lm_loss, random_tokens
from dapple.planner import Stage
from dapple.profiler import trace_layers

WORLD, SEQ, VOCAB = 4, 32, 512


def make(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=args.layers, n_head=4, n_embd=args.embd)


def plans(model: GPT, gbs: int) -> tuple[dapple.Plan, dapple.Plan]:
    """A: first half replicated on 2 ranks, then 2 straight stages; B: straight on 1 rank, rest on 3 replicas."""
    names = trace_layers(model).names
    n, h = len(names), len(names) // 2
    a = [Stage((0, h), [0, 1]), Stage((h, h + (n - h) // 2), [2]), Stage((h + (n - h) // 2, n), [3])]
    b = [Stage((0, h // 2), [0]), Stage((h // 2, n), [1, 2, 3])]
    return (dapple.Plan(gbs, 6, a, layer_names=names), dapple.Plan(gbs, 6, b, layer_names=names))


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def run(args: argparse.Namespace, root: str) -> dict:
    torch.set_num_threads(1)
    x, y = random_tokens(args.batch, SEQ, VOCAB, generator=torch.Generator().manual_seed(1))
    model = make(args)
    a, b = plans(model, args.batch)
    pipe = dapple.pipeline(model, a, lm_loss, timeout=300)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)

    def step(p, o):
        p.train_step(x, y)
        o.step()
        o.zero_grad()
    step(pipe, opt)
    replans, moved, parts = [], [], []
    for r in range(2 * args.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        sw = pipe.replan(b if r % 2 == 0 else a, opt)
        step(pipe, opt)
        replans.append(_slowest(time.perf_counter() - t0))
        parts.append((_slowest(sw.build_seconds), _slowest(sw.move_seconds)))
        total = torch.tensor([sw.sent_bytes], dtype=torch.float64)
        dist.all_reduce(total)
        moved.append(float(total))
    restarts, current = [], pipe.plan
    for r in range(2 * args.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        path = os.path.join(root, f"ck{r}")
        dapple.save_checkpoint(path, pipe, opt)
        nxt = b if current is a else a
        pipe = dapple.pipeline(make(args), nxt, lm_loss, timeout=300)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
        dapple.load_checkpoint(path, pipe, opt)
        step(pipe, opt)
        current = nxt
        restarts.append(_slowest(time.perf_counter() - t0))
    t0 = time.perf_counter()
    for _ in range(3):
        step(pipe, opt)
    return {"replan_s": replans, "restart_s": restarts, "moved_mb": [m / 1e6 for m in moved],
            "build_s": [b for b, _ in parts], "move_s": [m for _, m in parts],
            "step_s": _slowest((time.perf_counter() - t0) / 3),
            "state_mb": sum(p.numel() * p.element_size() * 3 for p in model.parameters()) / 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3, help="switches each way")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as root:
        res = dapple.runtime.launch(run, WORLD, args, root)[0]
    med = statistics.median
    print(f"GPT {args.layers} x {args.embd}: parameters + AdamW state {res['state_mb']:.1f} MB; one step "
          f"{res['step_s'] * 1e3:.0f} ms; load average {os.getloadavg()[0]:.1f}")
    print("| switch, then one step | median s (of {}) | state moved, MB |\n|---|---:|---:|".format(2 * args.rounds))
    print(f"| pipe.replan (in memory) | {med(res['replan_s']):.2f} | {med(res['moved_mb']):.1f} |")
    print(f"|   of which building the new stage / moving the state | {med(res['build_s']):.2f} / "
          f"{med(res['move_s']):.2f} | |")
    print(f"| save_checkpoint + new pipeline + load_checkpoint | {med(res['restart_s']):.2f} | (all, via disk) |")


if __name__ == "__main__":
    main()
