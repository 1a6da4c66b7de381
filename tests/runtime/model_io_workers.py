"""Per-rank work for tests/runtime/test_model_io.py: a bias without batch rows sent whole, a cut no value may cross,
inputs by name (a padding mask, each rank's own rows), and plans that carry how their profile traced the model."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import dapple
from dapple.planner import Plan, Stage
from tests.cut_models import BiasNet, FlatNet, seq_loss
from tests.runtime.workers import _compare

GLOBAL, MICRO = 8, 4


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _steps(pipe: dapple.Pipeline, ref: nn.Module, loss_fn: Any, batches: list[tuple[Any, Any]],
           own_rows: bool = False) -> list[dict[str, Any]]:
    """Train steps of ``pipe`` and of ``ref`` (one process, the whole batch) on the same batches; inputs given as
    a tuple, or by name; with ``own_rows`` each rank passes only its rows (pipe.rows())."""
    out = []
    for xs, ys in batches:
        ref.zero_grad()
        ref_loss = loss_fn(ref(**xs) if isinstance(xs, dict) else ref(*xs), ys)
        ref_loss.backward()
        give_x, give_y = xs, ys
        if own_rows:
            rows = pipe.rows()
            give_x = {k: v[rows] for k, v in xs.items()} if rows and any(pipe.data.reads) else {}
            give_y = ys[rows] if pipe.data.targets else None
        for p in pipe.parameters():
            p.grad = None
        out.append(_compare(pipe, pipe.train_step(give_x, give_y), float(ref_loss), _grads(ref)))
    return out


def case_whole(stages: list[tuple], schedule: str = "dapple") -> dict[str, Any]:
    """BiasNet: its (1, T, T) bias crosses the cuts after blocks.0 whole; two steps (the second at another length)
    and an evaluation, float64."""
    torch.manual_seed(0)
    model = BiasNet().double()
    ref = copy.deepcopy(model)
    plan = Plan(GLOBAL, MICRO, [Stage(*s) for s in stages], schedule=schedule)
    pipe = dapple.pipeline(model, plan, seq_loss, timeout=30)
    gen = torch.Generator().manual_seed(1)
    batches = [((torch.randn(GLOBAL, t, 4, generator=gen, dtype=torch.float64),),
                torch.randint(0, 3, (GLOBAL, t), generator=gen)) for t in (6, 5)]
    steps = _steps(pipe, ref, seq_loss, batches)
    pipe.eval()
    ref.eval()
    x, y = batches[0]
    with torch.no_grad():
        ref_eval = float(seq_loss(ref(*x), y))
    whole = pipe._runner.shapes.whole(((tuple(x[0].shape[1:]), torch.float64),))  # which values went whole
    return {"steps": steps, "eval": abs(pipe.eval_step(x, y) - ref_eval) / ref_eval,
            "whole": sum(map(sum, whole))}


def case_uncut() -> str:
    """FlatNet cut after ``flat``, where (B * T, 8) crosses: every rank's first step raises, naming the layers."""
    model = FlatNet()
    plan = Plan(GLOBAL, MICRO, [Stage((0, 2), [0]), Stage((2, 3), [1, 2]), Stage((3, 4), [3])])
    pipe = dapple.pipeline(model, plan, seq_loss, timeout=30)
    try:
        pipe.train_step(torch.randn(GLOBAL, 6, 4), torch.randint(0, 3, (GLOBAL, 6)))
    except ValueError as e:
        return str(e)
    return "no error"


class MaskedMix(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, h: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # (B, T, d), (B, 1, T)
        w = h @ h.transpose(1, 2) / 4  # (B, T, T)
        if bias is not None:
            w = w + bias
        return h + torch.softmax(w, -1) @ torch.tanh(self.fc(h))


class PadMasked(nn.Module):
    """forward(tokens, pad_mask=None, scale=1.0): (B, T) ids -> (B, T, 3), padded keys masked out."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList([MaskedMix(8) for _ in range(2)])

    def forward(self, tokens: torch.Tensor, pad_mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        h = self.embed(tokens)
        bias = None if pad_mask is None else (1.0 - pad_mask[:, None, :].to(h.dtype)) * -1e4  # (B, 1, T)
        for b in self.blocks:
            h = b(h, bias)
        return self.head(h) * scale


def padded(rows: int, t: int, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Token ids and a padding mask whose odd rows end in 2 pads; targets per position."""
    mask = torch.ones(rows, t, dtype=torch.long)
    mask[1::2, t - 2:] = 0
    return ({"tokens": torch.randint(0, 16, (rows, t), generator=gen), "pad_mask": mask},
            torch.randint(0, 3, (rows, t), generator=gen))


def case_by_name() -> dict[str, Any]:
    """PadMasked traced from inputs by name, stage 0 on two replicas: a step on the global batch, one on each
    rank's own rows; an unknown name is refused, naming it."""
    torch.manual_seed(0)
    model = PadMasked().double()
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    plan = Plan(GLOBAL, MICRO, [Stage((0, 2), [0, 1]), Stage((2, 3), [2]), Stage((3, 4), [3])])
    pipe = dapple.pipeline(model, plan, seq_loss, timeout=30, example_inputs=padded(2, 6, gen)[0])
    batches = [padded(GLOBAL, 6, gen) for _ in range(2)]
    steps = _steps(pipe, ref, seq_loss, batches[:1]) + _steps(pipe, ref, seq_loss, batches[1:], own_rows=True)
    xs, ys = batches[0]
    with torch.no_grad():  # the mask changes the loss: the comparison above is not vacuous
        unmasked = abs(float(seq_loss(ref(xs["tokens"]), ys)) - float(seq_loss(ref(**xs), ys)))
    try:
        pipe.train_step({**xs, "mask": xs["pad_mask"]}, ys)
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    return {"steps": steps, "unmasked": unmasked, "names": list(pipe.data.input_names), "refused": refused}


def case_planned(path: str, model: nn.Module, loss_fn: Any, batch: tuple[Any, Any]) -> dict[str, Any]:
    """A plan from dapple.plan, loaded from YAML: dapple.pipeline(model, plan, loss_fn) and nothing else."""
    torch.manual_seed(0)
    ref = copy.deepcopy(model)
    pipe = dapple.pipeline(model, Plan.load(path), loss_fn, timeout=30)
    return _steps(pipe, ref, loss_fn, [batch])[0]


def run_cases(cases: dict[str, tuple]) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {name: fn(*args) for name, (fn, *args) in cases.items()}


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)
