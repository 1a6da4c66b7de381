"""Train a model larger than one device: built on the meta device, each rank makes real and loads only its stage of a
pretrained checkpoint, then trains (README section "Train a model larger than one device").

    PYTHONPATH=$PWD torchrun --nproc_per_node=4 examples/train_large.py --checkpoint path/to/llama

``--checkpoint`` is a transformers checkpoint directory (``config.json``, and ``model.safetensors`` or a sharded
``model.safetensors.index.json``), e.g. one ``save_pretrained`` or ``huggingface-cli download`` wrote. No rank ever
holds the whole model: rank 0 profiles it one layer at a time and plans it into ``--plan`` (once; a plan file already
there is used as it is) while the others wait; then every rank builds its stage, reads that stage's tensors from the
shards that hold them, trains on random tokens (put your data there), and all write a dapple checkpoint.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

import dapple


def lm_loss(out: transformers.modeling_outputs.CausalLMOutputWithPast, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the model's logits (B, T, V)."""
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def build(checkpoint: str) -> torch.nn.Module:
    """The checkpoint's model with every tensor on the meta device: shapes, no memory."""
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config).train()


def make_plan(model: torch.nn.Module, tokens: torch.Tensor, world: int, batch: int, memory: float | None,
              path: str) -> None:
    """Profile the meta model one layer at a time (each made real on this device, timed, freed) and plan it."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prof = dapple.profile(model, tokens[:4], lm_loss, batch_sizes=(2, 4), targets=tokens[:4], device=device)
    if memory is None and torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(0).total_memory
    cluster = dapple.Cluster.local(world, measure=False, device_memory=memory)  # one server of `world` devices
    plan = dapple.plan(prof, cluster, global_batch_size=batch)
    print(plan)
    plan.save(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a transformers checkpoint directory")
    p.add_argument("--plan", default="large_plan.yaml", help="the plan file (made on the first run)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--device-memory", type=float, default=None,
                   help="bytes each device has (default: the GPU's, or this machine's RAM per process)")
    p.add_argument("--save", default="large_ckpt", help="the dapple checkpoint written at the end")
    args = p.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # torchrun's environment
    rank, world = dist.get_rank(), dist.get_world_size()

    model = build(args.checkpoint)
    vocab = model.config.vocab_size
    data = torch.randint(0, vocab, (args.batch * args.steps, args.seq), generator=torch.Generator().manual_seed(1))
    if rank == 0 and not os.path.exists(args.plan):
        make_plan(model, data, world, args.batch, args.device_memory, args.plan)
    dist.barrier()

    pipe = dapple.pipeline(model, dapple.Plan.load(args.plan), lm_loss, example_inputs=data[:2])  # this stage only
    loaded = dapple.load_weights(pipe, args.checkpoint)  # this stage's tensors, from the shards holding them
    print(f"rank {rank} (stage {pipe.stage}): read {loaded.tensors} tensors, {loaded.bytes / 2**20:.1f} MiB from "
          f"{len(loaded.files)} file(s) in {loaded.seconds:.2f} s")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    for step in range(args.steps):
        batch = data[step * args.batch:(step + 1) * args.batch]
        loss = pipe.train_step(batch, batch)  # inputs, targets: the global batch on every rank
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step + 1}: loss {loss:.4f}")
    dapple.save_checkpoint(args.save, pipe, opt)  # by the model's state_dict names, each stage's part
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
