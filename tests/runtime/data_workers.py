"""Per-rank functions for the data-path tests: each rank passes only what it reads (its own rows, None elsewhere)
and gets the global-batch call's loss and gradients bit for bit (float64); per-rank mistakes; a loader."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import dapple
from dapple.models import GPT, lm_loss, random_tokens
from tests.runtime.workers import Chain, TwoInputs, _chain_data, _compare, _plan, _reference, weighted_loss

# per model: (build, loss_fn, a global batch as (inputs, targets) tuples of gbs rows)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable, Callable[[int], tuple[tuple, tuple]]]] = {
    "chain": (lambda: Chain().double(), F.cross_entropy, lambda gbs: tuple((t,) for t in _chain_data(gbs))),
    "two_inputs": (lambda: TwoInputs().double(), weighted_loss, lambda gbs: _two_inputs_data(gbs)),
    "gpt": (lambda: GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=8).double(), lm_loss,
            lambda gbs: tuple((t,) for t in random_tokens(gbs, 8, 32, generator=torch.Generator().manual_seed(2)))),
}


def _two_inputs_data(gbs: int) -> tuple[tuple, tuple]:
    gen = torch.Generator().manual_seed(5)
    x, z = (torch.randn(gbs, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    return (x, z), (torch.randint(0, 3, (gbs,), generator=gen), torch.rand(gbs, generator=gen, dtype=torch.float64))


def own(pipe: dapple.Pipeline, xs: tuple, ys: tuple, batch_size: int | None = None) -> tuple[Any, Any]:
    """This rank's train_step arguments: its rows of what it reads, None for the rest."""
    rows, d = pipe.rows(batch_size), pipe.data
    mine = tuple(x[rows] if reads else None for x, reads in zip(xs, d.reads))
    return (None if all(x is None for x in mine) else mine), (tuple(y[rows] for y in ys) if d.targets else None)


def _grads(pipe: dapple.Pipeline) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    for p in pipe.parameters():
        p.grad = None
    return out


def case_per_rank(model: str, stages: list, gbs: int, mbs: int) -> dict[str, Any]:
    """The global batch on every rank, then each rank's own rows (None where it reads nothing): the same loss,
    gradients and evaluation, exactly; both equal single-process training."""
    build, loss_fn, batch = MODELS[model]
    torch.manual_seed(0)
    net = build()
    pipe = dapple.pipeline(net, _plan(net, stages, gbs, mbs), loss_fn, timeout=30)
    xs, ys = batch(gbs)
    ref_loss, ref = _reference(net, loss_fn, xs, ys)
    whole = pipe.train_step(xs, ys)
    whole_grads = _grads(pipe)
    inputs, targets = own(pipe, xs, ys)
    loss = pipe.train_step(inputs, targets)
    out = _compare(pipe, loss, ref_loss, ref)
    grads = _grads(pipe)
    out.update(same_loss=loss == whole, same_grads=sorted(n for n in grads if torch.equal(grads[n], whole_grads[n])),
               names=sorted(grads), passed=(_none_or_rows(inputs), _none_or_rows(targets)),
               reads=list(pipe.data.reads), step=pipe.step)
    small = 2 * mbs  # an evaluation batch of another size: batch_size= says how many rows it has
    sx, sy = tuple(x[:small] for x in xs), tuple(y[:small] for y in ys)
    full_eval, full_kept = pipe.eval_step(sx, sy, outputs=True)
    own_eval, own_kept = pipe.eval_step(*own(pipe, sx, sy, small), outputs=True, batch_size=small)
    out["same_eval"] = full_eval == own_eval and [r for r, _ in full_kept] == [r for r, _ in own_kept] and all(
        torch.equal(a, b) for (_, a), (_, b) in zip(full_kept, own_kept))
    return out


def _none_or_rows(batch: Any) -> Any:
    return None if batch is None else [None if t is None else int(t.shape[0]) for t in batch]


def _attempt(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def case_mistakes(stages: list, gbs: int, mbs: int) -> dict[str, Any]:
    """GPT with the embedding alone on stage 0, so stage 1 reads the token ids too (rows compared between ranks
    0 and 1, 0 and 2). Each mistake makes every rank raise before anything runs; then mixed layouts train."""
    build, loss_fn, batch = MODELS["gpt"]
    torch.manual_seed(0)
    net = build()
    pipe = dapple.pipeline(net, _plan(net, stages, gbs, mbs), loss_fn, timeout=30)
    xs, ys = batch(gbs)
    inputs, targets = own(pipe, xs, ys)
    rank = pipe.ctx.rank
    short = (inputs[0][:-1],) if rank == 1 else inputs  # rank 1 drops a row
    other = (xs[0][pipe.data.rows()[::-1]],) if rank == 1 else inputs  # rank 1: its rows, in the wrong order
    missing = None if rank == 2 else inputs  # rank 2 reads the ids but passes none
    errors = {"short": _attempt(lambda: pipe.train_step(short, targets)),
              "other_rows": _attempt(lambda: pipe.train_step(other, targets)),
              "missing": _attempt(lambda: pipe.train_step(missing, targets))}
    ref_loss, ref = _reference(net, loss_fn, xs, ys)
    mixed = (xs, targets) if rank in (0, 3) else (inputs, ys)  # the global batch and own rows, mixed
    after = _compare(pipe, pipe.train_step(*mixed), ref_loss, ref)
    return {"errors": errors, "after": after, "step": pipe.step, "reads": list(pipe.data.reads)}


class Counting(Dataset):
    """A dataset that records which rows it was asked for."""

    def __init__(self, n: int):
        gen = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(n, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (n,), generator=gen)
        self.reads: list[int] = []

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads.append(i)
        return self.x[i], self.y[i]


def case_loader(stages: list, gbs: int, mbs: int, rows: int = 20, epochs: int = 2) -> dict[str, Any]:
    """pipeline_loader over a dataset that counts reads: each rank reads only its rows; every step equals
    single-process training on the step's global batch (sampler.global_indices); SGD on both between steps; a
    loader per rank for evaluation; a rank whose loader draws another order is caught by the batch's ids."""
    torch.manual_seed(0)
    net = Chain().double()
    pipe = dapple.pipeline(net, _plan(net, stages, gbs, mbs), F.cross_entropy, timeout=30)
    ref_net = copy.deepcopy(net).cpu()
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(ref_net.parameters(), lr=0.1)
    data = Counting(rows)
    loader = dapple.runtime.pipeline_loader(data, pipe, shuffle=True, seed=3)
    out: dict[str, Any] = {"steps": [], "reads": [], "batches": []}
    for epoch in range(epochs):
        loader.batch_sampler.set_epoch(epoch)
        data.reads.clear()
        for step, loaded in enumerate(loader):
            batch = loader.batch_sampler.global_indices(step)
            ref_loss, ref = _reference(ref_net, F.cross_entropy, data.x[batch], data.y[batch])
            out["steps"].append(_compare(pipe, pipe.train_step(*loaded), ref_loss, ref))
            out["batches"].append(batch)
            for n, p in ref_net.named_parameters():
                p.grad = ref[n].clone()
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        out["reads"].append(list(data.reads))
    valid = dapple.runtime.pipeline_loader(data, pipe, batch_size=2 * mbs, shuffle=False)  # another batch size
    out["eval"] = [(pipe.eval_step(*loaded), pipe.eval_step(data.x[rows], data.y[rows]))
                   for loaded, rows in zip(valid, map(valid.batch_sampler.global_indices, range(len(valid))))]
    # rank 3's loader draws another order: images and labels of different rows would train silently
    other = dapple.runtime.pipeline_loader(data, pipe, shuffle=True, seed=4 if pipe.ctx.rank == 3 else 3)
    out["desync"] = _attempt(lambda: pipe.train_step(*next(iter(other))))
    out["step"] = pipe.step
    return out


# Chain layers: blocks.0-3, head; TwoInputs: a, b, head (z is read with b: h * z follows it); GPT: wte, wpe, drop,
# blocks.0, blocks.1, ln_f, lm_head (the position ids on the stage of wpe read the token ids)
CASES: dict[str, tuple[Callable, tuple, dict]] = {
    "first_replicated": (case_per_rank, ("chain", [((0, 2), [0, 1]), ((2, 3), [2]), ((3, 5), [3])], 9, 3), {}),
    "last_replicated": (case_per_rank, ("chain", [((0, 1), [0]), ((1, 3), [1]), ((3, 5), [2, 3])], 8, 4), {}),
    "two_by_two_uneven": (case_per_rank, ("chain", [((0, 2), [0, 1]), ((2, 5), [2, 3])], 15, 5), {}),
    "later_stage_reads_input": (case_per_rank, ("two_inputs", [((0, 1), [0]), ((1, 2), [1]), ((2, 3), [2, 3])], 8,
                                                4), {}),
    "later_stage_reads_ids": (case_per_rank, ("gpt", [((0, 1), [0]), ((1, 4), [1, 2]), ((4, 7), [3])], 8, 4), {}),
    "mistakes": (case_mistakes, ([((0, 1), [0]), ((1, 4), [1, 2]), ((4, 7), [3])], 8, 4), {}),
    "loader": (case_loader, ([((0, 2), [0, 1]), ((2, 3), [2]), ((3, 5), [3])], 6, 3), {}),
}


def run_cases(cases: dict[str, tuple[Callable, tuple, dict]]) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {name: fn(*args, **kw) for name, (fn, args, kw) in cases.items()}
