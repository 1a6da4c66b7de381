"""Per-rank functions for the multi-process runtime tests: tiny float64 models, plans, reference gradients."""

from __future__ import annotations

import copy
import functools
import os
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import dapple
from dapple.models import GPT, ResNet, lm_loss
from dapple.planner import Plan, Stage
from dapple.profiler import trace_layers
from dapple.runtime.distributed import init_distributed
from tests.conftest import EXPORT_OK
from tests.runtime._spawn import reported, stall_until_reported


class Chain(nn.Module):
    """``depth`` Linear+tanh blocks and a head: x (B, 6) -> (B, 3). Layers: blocks.0 .. blocks.{d-1}, head."""

    def __init__(self, depth: int = 4, width: int = 6):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Skip(nn.Module):
    """A long skip: a0 (made in layer 0) is used again in layer 2. Layers: l0, l1, l2, head."""

    def __init__(self, width: int = 6):
        super().__init__()
        self.l0, self.l1, self.l2 = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a0 = torch.tanh(self.l0(x))
        a1 = torch.tanh(self.l1(a0))
        a2 = torch.tanh(self.l2(a1) * a0)  # a0 crosses stage 1 (relayed)
        return self.head(a2 + a0)


class TwoInputs(nn.Module):
    """forward(x, z): x (B, 6) through a and b; z (B, 6) is used only by the head. Layers: a, b, head."""

    def __init__(self, width: int = 6):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, 3)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.head(h * z)


def weighted_loss(out: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Two targets: class labels y (B,) and per-row weights w (B,)."""
    return (F.cross_entropy(out, y, reduction="none") * w).mean()


_SCHEDULE: list[str | None] = [None]  # the schedule of every case's plan that names none (run_with_schedule)


def _plan(model: nn.Module, stages: list[tuple], gbs: int, mbs: int, **kw: Any) -> Plan:
    """Stages as (layers, devices) or (layers, devices, warmup K_i)."""
    if _SCHEDULE[0] is not None:
        kw.setdefault("schedule", _SCHEDULE[0])
    names = trace_layers(model).names
    return Plan(global_batch_size=gbs, micro_batch_size=mbs, stages=[Stage(*st) for st in stages],
                layer_names=names, **kw)


def _reference(model: nn.Module, loss_fn: Callable, x: Any, y: Any) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process loss and gradients on the whole batch; x and y may be tuples (several inputs, targets)."""
    ref = copy.deepcopy(model).cpu()  # the pipeline moved its stage's layers (shared with ``model``) to its device
    xs, ys = x if isinstance(x, tuple) else (x,), y if isinstance(y, tuple) else (y,)
    loss = loss_fn(ref(*xs), *ys)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in ref.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _compare(pipe: dapple.Pipeline, loss: float, ref_loss: float, ref: dict[str, torch.Tensor], scale: float = 1.0
             ) -> dict[str, Any]:
    errs = {}
    for name, p in pipe.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        errs[name] = _rel(g.detach().cpu(), scale * ref[name])
    return {"loss": abs(loss - ref_loss) / abs(ref_loss), "grads": errs, "expected": sorted(ref),
            "stage": pipe.stage}


def _chain_data(gbs: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(gbs, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (gbs,), generator=gen)


def case_chain(stages, gbs, mbs, steps: int = 1, accumulate: bool = False, depth: int = 4, **kw) -> list[dict]:
    """Chain model (``depth`` blocks and a head): each step compares loss and gradients; then SGD on both, so later
    steps check updates too."""
    torch.manual_seed(0)
    model = Chain(depth).double()
    plan = _plan(model, stages, gbs, mbs, **kw)
    pipe = dapple.pipeline(model, plan, F.cross_entropy, timeout=30)
    launches = _watch_bucket_launches(pipe)
    ref_model = copy.deepcopy(model).cpu()
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(ref_model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        x, y = _chain_data(gbs, seed=step)
        ref_loss, ref = _reference(ref_model, F.cross_entropy, x, y)
        loss = pipe.train_step(x, y)
        if accumulate:  # a second call without zero_grad adds the same gradient again
            pipe.train_step(x, y)
        out.append(_compare(pipe, loss, ref_loss, ref, 2.0 if accumulate else 1.0))
        out[-1]["buckets"] = (len(pipe._reducer.buckets), sum(launches))
        out[-1]["flat"] = [f.data_ptr() if f is not None else None for f in pipe._reducer._flat]
        launches.clear()
        for n, p in ref_model.named_parameters():
            p.grad = ref[n].clone()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    return out


def _watch_bucket_launches(pipe: dapple.Pipeline) -> list[bool]:
    """Record, for each gradient AllReduce bucket launched, whether it started during the last backward."""
    reducer, seen = pipe._reducer, []
    launch = reducer._launch

    def watched(k: int) -> None:
        seen.append(reducer._armed)
        launch(k)
    reducer._launch = watched
    return seen


def case_skip(stages, gbs, mbs) -> list[dict]:
    torch.manual_seed(0)
    model = Skip().double()
    pipe = dapple.pipeline(model, _plan(model, stages, gbs, mbs), F.cross_entropy, timeout=30)
    x, y = _chain_data(gbs)
    ref_loss, ref = _reference(model, F.cross_entropy, x, y)
    return [_compare(pipe, pipe.train_step(x, y), ref_loss, ref)]


def case_gpt(stages, gbs, mbs, seqs=(8,)) -> list[dict]:
    """Tiny GPT (tied embedding/head), one step per sequence length in ``seqs``."""
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=8).double()
    pipe = dapple.pipeline(model, _plan(model, stages, gbs, mbs), lm_loss, timeout=30)
    out = []
    for i, t in enumerate(seqs):
        x, y = dapple.models.random_tokens(gbs, t, 32, generator=torch.Generator().manual_seed(i))
        ref_loss, ref = _reference(model, lm_loss, x, y)
        out.append(_compare(pipe, pipe.train_step(x, y), ref_loss, ref))
        for p in pipe.parameters():
            p.grad = None
    return out


def case_clip(stages, gbs, mbs) -> list[dict]:
    """pipe.clip_grad_norm_ on a tied GPT with a replicated stage: the total norm and the clipped gradients equal
    torch.nn.utils.clip_grad_norm_ on the single-process model (2-norm clipped, inf-norm clipped, not clipped)."""
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=8).double()
    pipe = dapple.pipeline(model, _plan(model, stages, gbs, mbs), lm_loss, timeout=30)
    x, y = dapple.models.random_tokens(gbs, 8, 32, generator=torch.Generator().manual_seed(7))
    out = []
    for norm_type, max_norm in ((2.0, 0.05), (float("inf"), 0.01), (2.0, 1e3)):
        ref_loss, ref = _reference(model, lm_loss, x, y)
        clipped = copy.deepcopy(model).cpu()
        for n, q in clipped.named_parameters():
            q.grad = ref[n].clone()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(clipped.parameters(), max_norm, norm_type))
        loss = pipe.train_step(x, y)
        norm = pipe.clip_grad_norm_(max_norm, norm_type)
        res = _compare(pipe, loss, ref_loss, {n: q.grad for n, q in clipped.named_parameters()})
        out.append({**res, "norm": abs(norm - ref_norm) / ref_norm, "clipped": ref_norm > max_norm})
        for q in pipe.parameters():
            q.grad = None
    return out


def case_seeds_differ(stages, gbs, mbs, gpt: bool = False) -> list[dict]:
    """Every rank builds the model from its own seed (a mistake): dapple.pipeline gives each replica and tied copy
    its root's values (the stage's first replica), as DDP does, and the step equals single-process training of
    the model so assembled."""
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(100 + rank)
    model = (GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=8) if gpt else Chain()).double()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = _plan(model, stages, gbs, mbs)
    pipe = dapple.pipeline(model, plan, lm_loss if gpt else F.cross_entropy, timeout=30)
    mine = {n: p.detach().cpu().clone() for n, p in pipe.named_parameters()}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (pipe.stage, mine, before))
    first: dict[str, int] = {}  # name -> the lowest stage holding it
    for stage, held, _ in everyone:
        for n in held:
            first[n] = min(first.get(n, stage), stage)
    want = {n: everyone[plan.stages[s].devices[0]][2][n] for n, s in first.items()}
    unequal = sorted(f"rank {r}: {n}" for r, (_, held, _) in enumerate(everyone) for n, t in held.items()
                     if not torch.equal(t, want[n]))
    ref_model = copy.deepcopy(model).cpu()
    with torch.no_grad():
        for n, p in ref_model.named_parameters():
            p.copy_(want[n])
    x, y = (dapple.models.random_tokens(gbs, 8, 32, generator=torch.Generator().manual_seed(3)) if gpt
            else _chain_data(gbs))
    ref_loss, ref = _reference(ref_model, lm_loss if gpt else F.cross_entropy, x, y)
    differed = any(not torch.equal(before[n], everyone[0][2][n]) for n in before)  # this rank's seed vs rank 0's
    return [{**_compare(pipe, pipe.train_step(x, y), ref_loss, ref), "unequal": unequal,
             "differed": differed or rank == 0}]


class Gained(nn.Module):
    """tanh(lin(x)) * gain, the gain used only through .detach(): it never gets a gradient."""

    def __init__(self, width: int = 6):
        super().__init__()
        self.lin, self.gain = nn.Linear(width, width), nn.Parameter(torch.full((width,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.gain.detach()


def case_no_gradient(stages, gbs, mbs) -> list[dict]:
    """Parameters that get no gradient keep ``.grad is None`` on every rank (replicated stage included), as on one
    device, and AdamW with weight decay leaves them where single-process training does."""
    torch.manual_seed(0)
    model = Chain().double()
    model.blocks = nn.ModuleList([Gained().double() for _ in range(4)])
    pipe = dapple.pipeline(model, _plan(model, stages, gbs, mbs), F.cross_entropy, timeout=30)
    ref_model = copy.deepcopy(model).cpu()
    x, y = _chain_data(gbs)
    F.cross_entropy(ref_model(x), y).backward()
    pipe.train_step(x, y)
    none_ref = {n for n, p in ref_model.named_parameters() if p.grad is None}
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.1, weight_decay=0.5)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.1, weight_decay=0.5)
    opt.step(), ref_opt.step()
    ref_values = dict(ref_model.named_parameters())
    return [{"none": sorted(n for n, p in pipe.named_parameters() if p.grad is None),
             "none_expected": sorted(n for n, _ in pipe.named_parameters() if n in none_ref),
             "moved": sorted(n for n, p in pipe.named_parameters() if n in none_ref
                             and not torch.equal(p.detach().cpu(), ref_values[n].detach()))}]


def case_shards(stages, gbs, mbs) -> dict[str, Any]:
    """The DDP habit: each rank passes its own rows (same shapes). Every rank raises before any transfer, for
    different inputs and for different targets alone; check_inputs=False lets it through; then a correct step."""
    torch.manual_seed(0)
    model = Chain().double()
    plan = _plan(model, stages, gbs, mbs)
    pipe = dapple.pipeline(model, plan, F.cross_entropy, timeout=30)
    rank = int(os.environ["RANK"])
    x, y = _chain_data(gbs, seed=10 + rank)  # this rank's own shard
    same_x, same_y = _chain_data(gbs)
    errors = []
    for xs, ys in ((x, y), (same_x, y)):
        try:
            pipe.train_step(xs, ys)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    ref_loss, ref = _reference(model, F.cross_entropy, same_x, same_y)
    after = _compare(pipe, pipe.train_step(same_x, same_y), ref_loss, ref)
    unchecked = dapple.pipeline(copy.deepcopy(model), plan, F.cross_entropy, timeout=30, check_inputs=False)
    unchecked.train_step(x, y)  # trains on a mix of the ranks' rows: what the check is for
    return {"errors": errors, "after": after, "step": pipe.step}


def case_repeatable(stages, gbs, mbs) -> dict[str, list[float]]:
    """Dropout: each rank draws from its own torch RNG, so the same seed and plan give the same losses run after
    run, and another seed other ones."""
    def run(seed: int) -> list[float]:
        torch.manual_seed(0)
        model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=8, dropout=0.3).double()
        pipe = dapple.pipeline(model, _plan(model, stages, gbs, mbs), lm_loss, timeout=30)
        torch.manual_seed(seed)  # the masks' seed
        x, y = dapple.models.random_tokens(gbs, 8, 32, generator=torch.Generator().manual_seed(1))
        return [pipe.train_step(x, y) for _ in range(2)]
    return {"first": run(5), "again": run(5), "other": run(6)}


def case_inputs_differ(stages, gbs, mbs) -> dict[str, Any]:
    """Rank 3 is given sequences of 5 tokens, the others 8: every rank raises before any transfer (stage 1
    would receive (4, 8, 8) activations into (4, 5, 8) buffers); then a step with the same batch everywhere."""
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=8).double()
    pipe = dapple.pipeline(model, _plan(model, stages, gbs, mbs), lm_loss, timeout=30)
    seq = 5 if int(os.environ["RANK"]) == 3 else 8
    try:
        pipe.train_step(*dapple.models.random_tokens(gbs, seq, 32))
        error = None
    except ValueError as e:
        error = str(e)
    x, y = dapple.models.random_tokens(gbs, 8, 32, generator=torch.Generator().manual_seed(0))
    ref_loss, ref = _reference(model, lm_loss, x, y)
    return {"error": error, "after": _compare(pipe, pipe.train_step(x, y), ref_loss, ref), "step": pipe.step}


def case_nanogpt_export(stages, gbs, mbs, seqs=(8, 12)) -> list[dict]:
    """nanoGPT as written (length assert, buffer-sliced attention): only torch.export traces it."""
    from tests.nanogpt import VOCAB, NanoGPT
    torch.manual_seed(0)
    model = NanoGPT(n_layer=2, flash=False).double()
    example = torch.randint(0, VOCAB, (2, seqs[0]))
    names = trace_layers(model, tracer="export", example_inputs=example).names
    plan = Plan(global_batch_size=gbs, micro_batch_size=mbs, stages=[Stage(*st) for st in stages], layer_names=names)
    pipe = dapple.pipeline(model, plan, lm_loss, timeout=30, tracer="export", example_inputs=example)
    out = []
    for i, t in enumerate(seqs):  # the sequence length changes between steps (dynamic dim)
        x, y = dapple.models.random_tokens(gbs, t, VOCAB, generator=torch.Generator().manual_seed(i))
        ref_loss, ref = _reference(model, lm_loss, x, y)
        out.append(_compare(pipe, pipe.train_step(x, y), ref_loss, ref))
        for p in pipe.parameters():
            p.grad = None
    return out


def case_two_inputs(stages, gbs, mbs) -> list[dict]:
    """Two inputs (the second skips to the last stage) and two targets: the global batch as tuples."""
    torch.manual_seed(0)
    model = TwoInputs().double()
    pipe = dapple.pipeline(model, _plan(model, stages, gbs, mbs), weighted_loss, timeout=30)
    gen = torch.Generator().manual_seed(5)
    x, z = (torch.randn(gbs, 6, generator=gen, dtype=torch.float64) for _ in range(2))  # (gbs, 6) each
    y, w = torch.randint(0, 3, (gbs,), generator=gen), torch.rand(gbs, generator=gen, dtype=torch.float64)
    ref_loss, ref = _reference(model, weighted_loss, (x, z), (y, w))
    return [_compare(pipe, pipe.train_step((x, z), (y, w)), ref_loss, ref)]


def case_resnet(stages, gbs, mbs) -> list[dict]:
    torch.manual_seed(0)
    model = ResNet(widths=(4, 8), depth=1, num_classes=3, norm="group").double()
    pipe = dapple.pipeline(model, _plan(model, stages, gbs, mbs), F.cross_entropy, timeout=30)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(gbs, 3, 8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 3, (gbs,), generator=gen)
    ref_loss, ref = _reference(model, F.cross_entropy, x, y)
    return [_compare(pipe, pipe.train_step(x, y), ref_loss, ref)]


def case_memory(m_values=(4, 8), schedules=("dapple", "gpipe")) -> dict[str, int]:
    """Peak saved-activation bytes of this rank per (schedule, M) at a fixed micro-batch size (straight 4)."""
    out = {}
    for schedule in schedules:
        for m in m_values:
            torch.manual_seed(0)
            model = Chain(width=64).double()
            plan = _plan(model, [((0, 1), [0]), ((1, 2), [1]), ((2, 3), [2]), ((3, 5), [3])], 4 * m, 4,
                         schedule=schedule)
            pipe = dapple.pipeline(model, plan, F.cross_entropy, timeout=30)
            x = torch.randn(4 * m, 64, dtype=torch.float64)
            y = torch.randint(0, 3, (4 * m,))
            with dapple.runtime.ActivationMeter(pipe.parameters()) as meter:
                pipe.train_step(x, y)
            out[f"{schedule}/{m}"] = meter.peak
    return out


def case_owned() -> dict[str, Any]:
    """Which parameters stay alive once the caller drops its model: only this rank's stage's (tied GPT)."""
    import gc
    import weakref
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=8).double()
    plan = _plan(model, [((0, 4), [0, 1]), ((4, 5), [2]), ((5, 7), [3])], 8, 4)
    refs = {n: weakref.ref(p) for n, p in model.named_parameters()}
    pipe = dapple.pipeline(model, plan, lm_loss, timeout=30)
    del model
    gc.collect()
    return {"alive": sorted(n for n, r in refs.items() if r() is not None),
            "mine": sorted(n for n, _ in pipe.named_parameters())}


# name -> (case function, args); every case uses all 4 ranks. Chain layers: blocks.0-3, head (5 layers).
CASES_4: dict[str, tuple[Callable, tuple, dict]] = {
    "straight_4": (case_chain, ([((0, 1), [0]), ((1, 2), [1]), ((2, 3), [2]), ((3, 5), [3])], 8, 2), {"steps": 2}),
    "pure_dp_4": (case_chain, ([((0, 5), [0, 1, 2, 3])], 12, 6), {"steps": 2}),
    "one_to_three": (case_chain, ([((0, 2), [0]), ((2, 5), [1, 2, 3])], 8, 4), {}),
    "three_to_one": (case_chain, ([((0, 3), [0, 1, 2]), ((3, 5), [3])], 8, 4), {}),
    "two_to_two_uneven": (case_chain, ([((0, 2), [0, 1]), ((2, 5), [2, 3])], 15, 5), {}),
    "one_two_one": (case_chain, ([((0, 1), [0]), ((1, 3), [1, 2]), ((3, 5), [3])], 9, 3), {"accumulate": True}),
    "gpipe": (case_chain, ([((0, 1), [0]), ((1, 3), [1, 2]), ((3, 5), [3])], 12, 3), {"schedule": "gpipe"}),
    "explicit_warmup": (case_chain, ([((0, 1), [0], 3), ((1, 3), [1, 2], 2), ((3, 5), [3], 2)], 15, 3), {}),
    # M = 1: the only micro-batch is also the last, so its backward arms the gradient AllReduce at once
    "one_micro_batch": (case_chain, ([((0, 1), [0]), ((1, 3), [1, 2]), ((3, 5), [3])], 6, 6), {"steps": 2}),
    "two_inputs_two_targets": (case_two_inputs, ([((0, 1), [0, 1]), ((1, 2), [2]), ((2, 3), [3])], 8, 4), {}),
    "policy_b": (case_chain, ([((0, 1), [0]), ((1, 2), [1]), ((2, 3), [2]), ((3, 5), [3])], 16, 2),
                 {"warmup_policy": "B"}),
    "long_skip": (case_skip, ([((0, 1), [0]), ((1, 2), [1, 2]), ((2, 4), [3])], 9, 3), {}),
    "gpt_tied_seq_change": (case_gpt, ([((0, 4), [0, 1]), ((4, 5), [2]), ((5, 7), [3])], 8, 4), {"seqs": (8, 5)}),
    # the embedding alone on stage 0: stage 1's position ids come first in the graph, and read the token ids too
    "gpt_embedding_alone": (case_gpt, ([((0, 1), [0]), ((1, 4), [1, 2]), ((4, 7), [3])], 8, 4), {}),
    # layers wte, wpe, drop, h.0, h.1, ln_f, lm_head; the tied lm_head/wte weight spans stages 0 and 2
    **({"nanogpt_export": (case_nanogpt_export, ([((0, 3), [0]), ((3, 4), [1, 2]), ((4, 7), [3])], 6, 3), {})}
       if EXPORT_OK else {}),  # torch.export: torch >= 2.9
    # cut before stem.2, a ReLU(inplace=True): the received activation is changed in place
    "resnet_2_to_2": (case_resnet, ([((0, 2), [0, 1]), ((2, 7), [2, 3])], 6, 3), {}),
    # layers wte, wpe, drop, h.0, h.1, ln_f, lm_head: the tied weight on stages 0 (2 replicas) and 2
    "clip_grad_norm": (case_clip, ([((0, 4), [0, 1]), ((4, 5), [2]), ((5, 7), [3])], 8, 4), {}),
    "seeds_differ": (case_seeds_differ, ([((0, 1), [0]), ((1, 3), [1, 2]), ((3, 5), [3])], 9, 3), {}),
    "seeds_differ_tied": (case_seeds_differ, ([((0, 4), [0, 1]), ((4, 5), [2]), ((5, 7), [3])], 8, 4),
                          {"gpt": True}),
    "no_gradient": (case_no_gradient, ([((0, 1), [0]), ((1, 3), [1, 2]), ((3, 5), [3])], 9, 3), {}),
    "shards": (case_shards, ([((0, 1), [0]), ((1, 3), [1, 2]), ((3, 5), [3])], 9, 3), {}),
    "repeatable": (case_repeatable, ([((0, 4), [0, 1]), ((4, 5), [2]), ((5, 7), [3])], 8, 4), {}),
    "inputs_differ": (case_inputs_differ, ([((0, 4), [0, 1]), ((4, 5), [2]), ((5, 7), [3])], 8, 4), {}),
    "memory": (case_memory, (), {}),
    "owned": (case_owned, (), {}),
}


CASES_2: dict[str, tuple[Callable, tuple, dict]] = {
    "straight_2": (case_chain, ([((0, 2), [0]), ((2, 5), [1])], 8, 2), {"steps": 2}),
    "pure_dp_2": (case_gpt, ([((0, 7), [0, 1])], 6, 3), {}),
}


def run_with_schedule(schedule: str, fn: Callable, /, *args: Any, **kw: Any) -> Any:
    """Run case ``fn`` with ``schedule`` as its plans' schedule (those that name none)."""
    _SCHEDULE[0] = schedule
    try:
        return fn(*args, **kw)
    finally:
        _SCHEDULE[0] = None


def with_schedule(cases: dict[str, tuple[Callable, tuple, dict]], schedule: str
                  ) -> dict[str, tuple[Callable, tuple, dict]]:
    """The same cases, their plans on ``schedule`` (picklable for the spawned ranks)."""
    return {name: (functools.partial(run_with_schedule, schedule, fn), args, kw) for name, (fn, args, kw) in
            cases.items()}


def run_cases(cases: dict[str, tuple[Callable, tuple, dict]]) -> dict[str, Any]:
    """Every case on this rank, one after the other (all ranks run the same sequence)."""
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    return {name: fn(*args, **kw) for name, (fn, args, kw) in cases.items()}


def _vanish_hook(rank: int, after: int, stall: bool) -> Callable:
    calls = [0]

    def hook(module: nn.Module, args: Any) -> None:
        calls[0] += 1
        if int(os.environ["RANK"]) == rank and calls[0] >= after:
            if stall:  # a stuck peer first, until the others have raised, then a vanished one
                stall_until_reported("failing_peer", int(os.environ["WORLD_SIZE"]) - 1)
            os._exit(0)
    return hook


def run_failing_peer(dying_rank: int, after_forwards: int, timeout: float, stall: bool = False) -> str:
    """Straight stages, one per rank; ``dying_rank`` exits in its n-th forward (with ``stall``, once the others
    have raised). Returns what this rank saw: the error message and how long after the step started it came."""
    torch.manual_seed(0)
    world = int(os.environ["WORLD_SIZE"])
    model = Chain(depth=world - 1).double()
    plan = _plan(model, [((i, i + 1), [i]) for i in range(world)], 8, 2)
    x, y = _chain_data(8)
    device = init_distributed(30.0).device  # join and load CUDA's kernels first: the short timeout is for steps
    if device.type == "cuda":
        F.cross_entropy(copy.deepcopy(model).to(device)(x.to(device)), y.to(device)).backward()
        torch.cuda.synchronize(device)
    # built, and its first step run, with a long timeout (building waits for the slowest rank's tracing, and a
    # first step for lazy initialisations: seconds on a busy machine); the next steps wait at most ``timeout``
    pipe = dapple.pipeline(model, plan, F.cross_entropy, timeout=30.0)
    first = next(m for m in pipe.module.modules() if isinstance(m, nn.Linear))
    first.register_forward_pre_hook(_vanish_hook(dying_rank, after_forwards, stall))
    for step in range(5):
        if step == 1:
            pipe.timeout = pipe._runner.timeout = pipe._batch_check.timeout = pipe._p2p.timeout = timeout
        t0 = time.monotonic()
        try:
            pipe.train_step(x, y)
        except dapple.runtime.PipelineError as e:
            seen = f"after {time.monotonic() - t0:.1f}s: {e}"
            reported("failing_peer")
            return seen
    return "no error"


def run_absent_rank(timeout: float, long_group_timeout: bool = False) -> str | None:
    """Rank 1 never calls dapple.pipeline (it sleeps past the timeout, then exits); what rank 0 saw, and when.
    ``long_group_timeout``: the group gets NCCL's longer timeout (2 x timeout + 30 s), whatever the backend."""
    if int(os.environ["RANK"]) == 1:
        time.sleep(timeout + 2)
        return None
    if long_group_timeout:
        from dapple.runtime import distributed
        distributed.group_timeout = lambda t, backend: timedelta(seconds=2 * t + 30)
    model = Chain().double()
    plan = _plan(model, [((0, 2), [0]), ((2, 5), [1])], 8, 2)
    t0 = time.monotonic()
    try:
        dapple.pipeline(model, plan, F.cross_entropy, timeout=timeout)
    except dapple.runtime.PipelineError as e:
        return f"after {time.monotonic() - t0:.1f}s: {e}"
    return "no error"
