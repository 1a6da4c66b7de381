"""Train a Hugging Face GPT-2 with dapple: profile, plan, pipeline, train, evaluate, checkpoint (README section).

    PYTHONPATH=$PWD torchrun --nproc_per_node=4 examples/train_hf.py

Every rank runs this script. Rank 0 profiles the model and plans it for the job's processes into ``--plan`` (once:
a plan file already there is used as it is), the others wait for it; then every rank builds its stage of the
pipeline, trains on random token batches, reports a validation loss in eval mode, and writes a checkpoint, which
rank 0 loads back into a plain ``GPT2LMHeadModel``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

import dapple


def lm_loss(out: transformers.modeling_outputs.CausalLMOutputWithCrossAttentions, tokens: torch.Tensor
            ) -> torch.Tensor:
    """The model's output as it returns it; next-token cross-entropy on its logits (B, T, V)."""
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def make_model(config: transformers.GPT2Config) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)  # every rank builds the same initial model
    return transformers.GPT2LMHeadModel(config).train()  # (from_pretrained returns a model in eval mode)


def make_plan(model: torch.nn.Module, data: torch.Tensor, world: int, path: str) -> None:
    """Profile the model (its layers: embeddings, each transformer block, final norm, head) and plan it."""
    prof = dapple.profile(model, data[:8], lm_loss, batch_sizes=(4, 8), targets=data[:8])
    print(prof)
    # 0.6x what one process needs to train the whole model, so that the plan is a pipeline (as on devices a model
    # outgrows); without device_memory it plans for this machine's RAM
    need = dapple.planner.memory_needed(prof)
    cluster = dapple.Cluster.local(world, measure=False, device_memory=0.6 * need)
    plan = dapple.plan(prof, cluster, global_batch_size=32)
    print(plan)
    plan.save(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", default="hf_plan.yaml", help="the plan file (made on the first run)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checkpoint", default="hf_ckpt", help="the checkpoint directory written at the end")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # torchrun's environment
    rank, world = dist.get_rank(), dist.get_world_size()

    config = transformers.GPT2Config(n_layer=4, n_head=4, n_embd=64, vocab_size=256, n_positions=64)
    data = torch.randint(0, 256, (96, 33), generator=torch.Generator().manual_seed(1))  # the same on every rank
    train, valid = data[:64], data[64:]
    if rank == 0 and not os.path.exists(args.plan):
        make_plan(make_model(config), train, world, args.plan)
    dist.barrier()

    model = make_model(config)
    pipe = dapple.pipeline(model, dapple.Plan.load(args.plan), lm_loss)  # traced as the plan's profile was
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    for step in range(args.steps):
        rows = torch.arange(step * 32, step * 32 + 32) % len(train)
        loss = pipe.train_step(train[rows], train[rows])  # the global batch on every rank: (inputs, targets)
        opt.step()
        opt.zero_grad()
        if step % 5 == 4:
            pipe.eval()  # dropout off
            val = pipe.eval_step(valid, valid)  # forward only, any multiple of the micro-batch size
            pipe.train()
            if rank == 0:
                print(f"step {step + 1}: loss {loss:.4f}, validation loss {val:.4f}")

    dapple.save_checkpoint(args.checkpoint, pipe, opt)
    if rank == 0:
        plain = transformers.GPT2LMHeadModel(config)
        plain.load_state_dict(dapple.load_full_state_dict(args.checkpoint))  # strict: exactly the model's keys
        print(f"checkpoint {args.checkpoint} loads into a plain {type(plain).__name__}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
