"""Per-rank function for the replan tests: a float64 model with a buffer, trained under one plan, switched to
another in memory, against a checkpoint reloaded under it and against one process."""

from __future__ import annotations

import copy
import gc
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dapple
from dapple.core.dist import PipelineError
from dapple.models import GPT, lm_loss, random_tokens
from tests.runtime.workers import _plan

A = [((0, 2), [0, 1]), ((2, 4), [2]), ((4, 7), [3])]  # layers: blocks.0 .. blocks.5, head
B = [((0, 4), [0]), ((4, 7), [1, 2, 3])]
GBS, MBS_A, MBS_B = 24, 4, 6


class Scale(nn.Module):
    """Multiplies by a buffer drawn at construction and adds a non-persistent one (not in the state_dict; a
    replan's new stage is built without values, so both must move)."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("scale", 0.5 + torch.rand(width))
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, width), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.offset


class Net(nn.Module):
    """6 Linear blocks, the second scaled by a buffer, and a head: x (B, 6) -> (B, 3)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(6, 6), Scale(6) if i == 1 else nn.Identity(), nn.Tanh()) for i in range(6)])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GBS, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (GBS,), generator=g)


def _model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().double()


def _optimizer(params) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW with two param groups (no decay on biases and norms) and a step LR schedule."""
    params = list(params)
    decay = [p for n, p in params if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in params if not (n.endswith("weight") and p.dim() > 1)]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=0.05, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _train(pipe, opt, sched, steps: range) -> list[float]:
    out = []
    for s in steps:
        out.append(pipe.train_step(*_data(s)))
        opt.step()
        sched.step()
        opt.zero_grad()
    return out


def _everything(pipe: dapple.Pipeline) -> dict[str, list]:
    """The whole model's state_dict, gathered from every rank's stage (every rank gets it), as lists."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.tolist() for k, v in pipe.state_dict().items()})
    return {k: v for part in parts for k, v in part.items()}


def run(root: str) -> dict[str, Any]:
    """Three runs of 6 steps: replanned A -> B after 3 (the switch's cost recorded), A then a checkpoint loaded
    under B, and one process; then a gradient accumulated across a switch B -> A, and bad replans."""
    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    model = _model()
    reference = copy.deepcopy(model)
    pipe = dapple.pipeline(model, _plan(model, A, GBS, MBS_A), F.cross_entropy, timeout=60)
    opt, sched = _optimizer(pipe.named_parameters())
    losses = _train(pipe, opt, sched, range(3))
    switch = pipe.replan(_plan(model, B, GBS, MBS_B), opt)
    out["switch"] = switch
    out["after_switch"] = {"stage": pipe.stage, "params": sorted(n for n, _ in pipe.named_parameters()),
                           "groups": [len(g["params"]) for g in opt.param_groups], "lr": sched.get_last_lr()}
    losses += _train(pipe, opt, sched, range(3, 6))
    out["replanned"], state = losses, _everything(pipe)

    model2 = _model()
    ck = dapple.pipeline(model2, _plan(model2, A, GBS, MBS_A), F.cross_entropy, timeout=60)
    opt2, sched2 = _optimizer(ck.named_parameters())
    losses2 = _train(ck, opt2, sched2, range(3))
    dapple.save_checkpoint(os.path.join(root, "ck"), ck, opt2, scheduler=sched2)
    model3 = _model(seed=7)  # other initial values: everything must come from the checkpoint
    ck = dapple.pipeline(model3, _plan(model3, B, GBS, MBS_B), F.cross_entropy, timeout=60)
    opt3, sched3 = _optimizer(ck.named_parameters())
    dapple.load_checkpoint(os.path.join(root, "ck"), ck, opt3, scheduler=sched3)
    out["reloaded"], out["reloaded_state"] = losses2 + _train(ck, opt3, sched3, range(3, 6)), _everything(ck)
    out["state"] = state

    ref_opt, ref_sched = _optimizer(reference.named_parameters())
    ref = []
    for s in range(6):
        x, y = _data(s)
        loss = F.cross_entropy(reference(x), y)
        loss.backward()
        ref.append(float(loss.detach()))
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
    out["one_process"] = ref

    # a gradient accumulated over two batches with a switch between them: the same as one process's
    x0, y0 = _data(10)
    x1, y1 = _data(11)
    pipe.train_step(x0, y0)
    pipe.replan(_plan(model, A, GBS, MBS_A), opt)
    pipe.train_step(x1, y1)
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    (F.cross_entropy(reference(x0), y0) + F.cross_entropy(reference(x1), y1)).backward()
    out["accumulated_error"] = max(float((g - dict(reference.named_parameters())[n].grad).abs().max())
                                   for n, g in grads.items())
    opt.zero_grad()

    errors = {}
    try:  # another world size: every rank raises before anything is built
        pipe.replan(_plan(model, [((0, 7), [0, 1])], GBS, MBS_A), opt)
    except ValueError as e:
        errors["world"] = str(e)
    try:  # an optimizer on some ranks only: found while describing, every rank raises, nothing changed
        pipe.replan(_plan(model, B, GBS, MBS_B), opt if rank != 2 else None)
    except (ValueError, PipelineError) as e:
        errors["optimizer"] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    out["usable_after_errors"] = pipe.train_step(*_data(20))
    out["stage_after_errors"] = pipe.stage
    out["gpt"] = tied_gpt()
    return out


def tied_gpt() -> dict[str, Any]:
    """A GPT whose LM head shares the embedding (a parameter of the first and last stages) switched between plans
    as one process trains it; afterwards no tensor of the model the pipeline was made from is held."""
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=8).double()  # layers: wte .. lm_head
    reference = copy.deepcopy(model)
    refs = [weakref.ref(t) for t in model.parameters()]
    pipe = dapple.pipeline(model, _plan(model, [((0, 4), [0, 1]), ((4, 5), [2]), ((5, 7), [3])], 12, 4), lm_loss,
                           timeout=60)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    losses, ref = [], []
    for step in range(4):
        if step == 2:
            pipe.replan(_plan(model, [((0, 3), [0]), ((3, 7), [1, 2, 3])], 12, 3), opt)
        x, y = random_tokens(12, 16, 32, generator=torch.Generator().manual_seed(step))
        losses.append(pipe.train_step(x, y))
        opt.step()
        opt.zero_grad()
        loss = lm_loss(reference(x), y)
        loss.backward()
        ref.append(float(loss.detach()))
        ref_opt.step()
        ref_opt.zero_grad()
    del model
    gc.collect()
    return {"losses": losses, "one_process": ref, "alive": sum(1 for r in refs if r() is not None)}
