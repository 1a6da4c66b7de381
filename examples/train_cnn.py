"""Train a ResNet with dapple on 4 CPU processes, each rank loading only the rows and tensors it uses.

    PYTHONPATH=$PWD torchrun --standalone --nproc_per_node=4 examples/train_cnn.py

``--image 224`` gives ImageNet-sized rows (3 x 224 x 224 float32).

The plan: stage 0 (stem and the first block) replicated on ranks 0 and 1, the middle blocks on rank 2, the pool
and classifier on rank 3. Stage 0's replicas read the images, each its half of every micro-batch; rank 3 reads
the labels; rank 2 reads nothing. ``dapple.runtime.pipeline_loader`` turns a map-style Dataset into a loader that
reads exactly that on each rank, and ``pipe.train_step(*batch)`` takes it. Before training, the example checks
that a validation pass on each rank's own rows gives the loss of the global-batch call, then prints the bytes
each rank passes to ``train_step`` per step both ways and how many dataset rows each rank read.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Dataset

import dapple
from dapple.models import ResNet
from dapple.planner import Stage
from dapple.profiler import trace_layers

CLASSES = 10


class Shapes(Dataset):
    """Synthetic images: a fixed pattern per class plus noise drawn from the row's index; counts its reads."""

    def __init__(self, rows: int, size: int):
        self.rows, self.size, self.reads = rows, size, 0
        self.patterns = torch.randn(CLASSES, 3, size, size, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        label = i % CLASSES
        noise = torch.randn(3, self.size, self.size, generator=torch.Generator().manual_seed(1000 + i))
        return self.patterns[label] + noise, torch.tensor(label)


def make_model() -> ResNet:
    torch.manual_seed(0)  # every rank builds the same initial model
    return ResNet(widths=(8, 16, 32), depth=1, num_classes=CLASSES)


def make_plan(batch: int, micro_batch: int) -> dapple.Plan:
    names = trace_layers(make_model()).names  # stem.0, stem.1, stem.2, layers.0, layers.1, layers.2, pool, fc
    cut1, cut2 = names.index("layers.1"), names.index("pool")
    return dapple.Plan(global_batch_size=batch, micro_batch_size=micro_batch, layer_names=names,
                       stages=[Stage((0, cut1), [0, 1]), Stage((cut1, cut2), [2]), Stage((cut2, len(names)), [3])])


def nbytes(batch: object) -> int:
    """The bytes of the tensors in a (nested) batch; None counts 0."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, (tuple, list)):
        return sum(nbytes(b) for b in batch)
    return 0


def check_own_rows(pipe: dapple.Pipeline, data: Shapes) -> tuple[float, float, int, int]:
    """A validation pass on the first global batch, as the global batch and as this rank's own rows."""
    valid = dapple.runtime.pipeline_loader(data, pipe, shuffle=False)
    own = next(iter(valid))
    rows = valid.batch_sampler.global_indices(0)
    items = [data[i] for i in rows]
    whole = (torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))
    pipe.eval()
    losses = pipe.eval_step(*whole), pipe.eval_step(*own)
    pipe.train()
    return losses[0], losses[1], nbytes(whole), nbytes(own)  # own: inputs, targets and ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=32, help="global batch (rows per step)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--image", type=int, default=32, help="image side in pixels (3 x image x image, float32)")
    p.add_argument("--rows", type=int, default=256, help="dataset rows")
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()

    torch.set_num_threads(1)
    pipe = dapple.pipeline(make_model(), make_plan(args.batch, args.micro_batch), F.cross_entropy, timeout=300)
    rank = dist.get_rank()
    if rank == 0:
        print(pipe.plan)
    data = Shapes(args.rows, args.image)
    whole_loss, own_loss, whole_bytes, own_bytes = check_own_rows(pipe, data)
    data.reads = 0
    loader = dapple.runtime.pipeline_loader(data, pipe, shuffle=True, seed=0)
    opt = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    step, epoch = 0, 0
    while step < args.steps:
        loader.batch_sampler.set_epoch(epoch)  # the same permutation on every rank, a new one each epoch
        for batch in loader:  # (inputs, targets, batch_size, ids): this rank's rows, None where it reads nothing
            loss = pipe.train_step(*batch)
            opt.step()
            opt.zero_grad()
            step += 1
            if rank == 0 and (step == 1 or step % 5 == 0):
                print(f"step {step:3d}  loss {loss:.4f}")
            if step == args.steps:
                break
        epoch += 1
    d = pipe.data
    report = (rank, d.stage, d.replica, len(pipe.rows()), whole_bytes, own_bytes, data.reads)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, report)
    if rank == 0:
        print(f"validation loss on the first batch: global batch {whole_loss:.12f}, own rows {own_loss:.12f}")
        print(f"bytes passed to train_step per step ({args.batch} images of 3x{args.image}x{args.image} float32 and "
              f"their int64 labels; own rows: with their int64 dataset ids), and dataset rows read in {args.steps} "
              f"steps:")
        print("rank  stage  replica  rows  global batch   own rows   rows read")
        for r, s, rep, n, whole, own, reads in everyone:
            print(f"{r:4d}  {s:5d}  {rep:7d}  {n:4d}  {whole:12,d}  {own:9,d}  {reads:10d}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
