"""Per-rank work for tests/hf/test_plans.py: plans loaded from YAML run with ``dapple.pipeline(model, plan, loss_fn)``
alone, inputs given by name, against single-process float64 training."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

import dapple
from tests.hf.models import by_name
from tests.hf.workers import _errors

GLOBAL = 8
LENGTHS = (8, 6)  # sequence length of step 1 and step 2


def run_plan(path: str, make: Callable, loss_fn: Callable, decoder: bool) -> dict[str, Any]:
    """Two steps (the second at another length) and an evaluation: loss and gradients against one process."""
    torch.manual_seed(0)
    model = make().double()
    ref = copy.deepcopy(model)
    pipe = dapple.pipeline(model, dapple.Plan.load(path), loss_fn, timeout=60)  # nothing else: the plan says it
    gen = torch.Generator().manual_seed(1)
    steps = []
    for length in LENGTHS:
        xs, ys = by_name(GLOBAL, length, gen, decoder)
        ref.zero_grad()
        ref_loss = loss_fn(ref(**xs), *ys)
        ref_loss.backward()
        grads = {n: p.grad for n, p in ref.named_parameters()}
        loss = pipe.train_step(xs, ys)
        steps.append({"loss": abs(loss - float(ref_loss)) / float(ref_loss),
                      "grads": {n: _errors(p.grad, grads[n])[1] for n, p in pipe.named_parameters()}})
        for p in pipe.parameters():
            p.grad = None
    pipe.eval()
    ref.eval()
    xs, ys = by_name(GLOBAL, LENGTHS[0], gen, decoder)
    with torch.no_grad():
        ref_eval = float(loss_fn(ref(**xs), *ys))
    whole = pipe._runner.shapes._whole.values()  # per input shape seen: which boundary values went whole
    return {"steps": steps, "eval": abs(pipe.eval_step(xs, ys) - ref_eval) / ref_eval, "stage": pipe.stage,
            "whole": max((sum(map(sum, flags)) for flags in whole), default=0)}


def run_all(cases: dict[str, tuple]) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    return {name: run_plan(*args) for name, args in cases.items()}
