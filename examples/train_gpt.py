"""Train a small GPT with dapple on 4 CPU processes, from a plan file; prints the loss going down.

    PYTHONPATH=$PWD torchrun --nproc_per_node=4 examples/train_gpt.py --plan examples/gpt_plan.yaml

The plan file says which layers each stage holds and on which ranks (see docs/design.md, "Plan"). Until
``dapple plan`` can make one from a profile, write it by hand: list the model's layers with
``trace_layers`` (the same grouping the profiler and the runtime use) and cut between them:

    import dapple
    from dapple.planner import Stage
    from dapple.profiler import trace_layers
    names = trace_layers(GPT(...)).names  # ['wte', 'wpe', 'drop', 'blocks.0', ..., 'ln_f', 'lm_head']
    plan = dapple.Plan(global_batch_size=32, micro_batch_size=8, layer_names=names,
                       stages=[Stage((0, 5), [0, 1]),    # embeddings + blocks 0-1, replicated on ranks 0, 1
                               Stage((5, 7), [2]),       # blocks 2-3 on rank 2
                               Stage((7, 9), [3])])      # final norm + LM head (tied to wte) on rank 3
    plan.save("examples/gpt_plan.yaml")

``python examples/train_gpt.py --write-plan examples/gpt_plan.yaml`` does exactly this for the model below.
``--save DIR`` writes a checkpoint at the end, ``--resume DIR`` continues from one (made under any plan).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import dapple
from dapple.models import GPT, lm_loss
from dapple.planner import Stage
from dapple.profiler import trace_layers


def make_model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)  # every rank builds the same initial model
    return GPT(vocab_size=args.vocab, block_size=args.seq, n_layer=4, n_head=4, n_embd=args.embd)


def write_plan(args: argparse.Namespace) -> None:
    names = trace_layers(make_model(args)).names
    blocks2 = names.index("blocks.2")
    plan = dapple.Plan(global_batch_size=32, micro_batch_size=8, layer_names=names,
                       stages=[Stage((0, blocks2), [0, 1]), Stage((blocks2, names.index("ln_f")), [2]),
                               Stage((names.index("ln_f"), len(names)), [3])])
    plan.save(args.write_plan)
    print(plan)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", default="examples/gpt_plan.yaml")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--write-plan", metavar="PATH", help="write a hand-made plan for this model and exit")
    p.add_argument("--save", metavar="DIR", help="write a checkpoint (dapple.save_checkpoint) after the last step")
    p.add_argument("--resume", metavar="DIR", help="continue from a checkpoint, whichever plan wrote it")
    p.add_argument("--shard-optimizer", action="store_true",
                   help="shard AdamW's state over each stage's replicas (dapple.shard_optimizer; the default where "
                        "the plan was made with shard_optimizer=True)")
    args = p.parse_args()
    if args.write_plan:
        return write_plan(args)

    torch.set_num_threads(1)
    plan = dapple.Plan.load(args.plan)
    pipe = dapple.pipeline(make_model(args), plan, lm_loss, timeout=120)
    if args.shard_optimizer or plan.shard_optimizer:  # ZeRO-1: each replica holds its share of the state
        opt = dapple.shard_optimizer(pipe, torch.optim.AdamW, lr=args.lr)
    else:
        opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    rank = dist.get_rank()
    if rank == 0:
        print(plan)
    # A fixed set of 64 random sequences: learnable (memorised), so the loss falls. Same batches on every rank.
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, args.vocab, (64, args.seq + 1), generator=gen)
    start = 0
    if args.resume:  # parameters, AdamW state, lr, and where the data order was
        extra = dapple.load_checkpoint(args.resume, pipe, opt)
        start = extra["step"]
        gen.set_state(extra["data_rng"])
    t0 = time.perf_counter()
    for step in range(start + 1, start + args.steps + 1):
        rows = torch.randperm(64, generator=gen)[:plan.global_batch_size]
        loss = pipe.train_step(data[rows, :-1], data[rows, 1:])  # the global batch, identical on all ranks
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step == start + 1 or step % 5 == 0):
            print(f"step {step:3d}  loss {loss:.4f}  ({(time.perf_counter() - t0) / (step - start) * 1e3:.0f} "
                  f"ms/step)", flush=True)
    if args.save:
        dapple.save_checkpoint(args.save, pipe, opt, extra={"step": start + args.steps, "data_rng": gen.get_state()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
