"""Per-rank functions for the training-feature tests: mixed precision, recomputation, the loss checks."""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import dapple
from dapple.models import GPT, ResNet, lm_loss
from tests.runtime.workers import Chain, _chain_data, _compare, _plan, _reference

GPT_STAGES = [((0, 4), [0, 1]), ((4, 5), [2]), ((5, 7), [3])]  # wte..h.0 twice, h.1, ln_f + tied lm_head
CHAIN_STAGES = [((0, 1), [0]), ((1, 3), [1, 2]), ((3, 5), [3])]


def _gpt(dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16).to(dtype)


def _tokens(gbs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return dapple.models.random_tokens(gbs, 8, 32, generator=torch.Generator().manual_seed(seed))


def _autocast_reference(model: nn.Module, dtype: torch.dtype, x: torch.Tensor, y: torch.Tensor
                        ) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process training step under torch.autocast (no loss scaling: the gradients as they are)."""
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=dtype):
        loss = lm_loss(ref(x), y)
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in ref.named_parameters()}


def _wire_dtypes(pipe: dapple.Pipeline) -> list[str]:
    """Record the dtypes this rank sends (activations and gradients) from now on."""
    seen: list[str] = []
    send = pipe._p2p.send

    def watched(t, tensor):
        seen.append(f"{t.kind}:{tensor.dtype}")
        send(t, tensor)
    pipe._p2p.send = watched
    return seen


def case_bf16() -> dict[str, Any]:
    """bf16 autocast: the loss and gradients against single-process autocast (float32 model), the wire dtype."""
    model = _gpt()
    pipe = dapple.pipeline(model, _plan(model, GPT_STAGES, 8, 4), lm_loss, timeout=30, mixed_precision="bf16")
    x, y = _tokens(8)
    ref_loss, ref = _autocast_reference(model, torch.bfloat16, x, y)
    sent = _wire_dtypes(pipe)
    res = _compare(pipe, pipe.train_step(x, y), ref_loss, ref)
    _, full = _reference(model, lm_loss, x, y)
    vs_fp32 = max(float((ref[n] - g).abs().max() / g.abs().max()) for n, g in full.items())
    return {**res, "sent": sorted(set(sent)), "vs_fp32": vs_fp32,
            "param_dtypes": sorted({str(p.dtype) for p in pipe.parameters()}),
            "grad_dtypes": sorted({str(p.grad.dtype) for p in pipe.parameters() if p.grad is not None})}


def case_plan_precision(run_as: str | None) -> dict[str, Any]:
    """A plan made for bf16 (Plan.mixed_precision) run with ``run_as`` (None: as the plan says): the wire dtypes, and
    the warnings about running it otherwise."""
    model = _gpt()
    plan = _plan(model, GPT_STAGES, 8, 4, mixed_precision="bf16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = dapple.pipeline(model, plan, lm_loss, timeout=30, mixed_precision=run_as)
    sent = _wire_dtypes(pipe)
    pipe.train_step(*_tokens(8))
    warned = [str(w.message) for w in caught if "mixed_precision" in str(w.message)]
    return {"sent": sorted(set(sent)), "warned": warned}


def case_fp16_overflow() -> dict[str, Any]:
    """fp16 with loss scaling: a normal step, then one where only rank 2's activations overflow: every rank skips
    the optimizer step and halves the scale; then training goes on."""
    model = _gpt()
    pipe = dapple.pipeline(model, _plan(model, GPT_STAGES, 8, 4), lm_loss, timeout=30, mixed_precision="fp16")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y = _tokens(8)
    ref_loss, ref = _autocast_reference(model, torch.float16, x, y)
    scales, stepped, found = [pipe.scaler.scale], [], []
    first = None
    blow = [False]
    if int(os.environ["RANK"]) == 2:
        pipe.module.register_forward_hook(lambda mod, args, out: tuple(o * 1e30 for o in out) if blow[0] else None)
    for step in range(3):
        blow[0] = step == 1
        loss = pipe.train_step(x, y)
        if step == 0:
            first = _compare(pipe, loss, ref_loss, ref)
        found.append(pipe.scaler.found_inf)
        before = [p.detach().clone() for p in pipe.parameters()]
        stepped.append(pipe.scaler.step(opt))
        moved = any(not torch.equal(b, p) for b, p in zip(before, pipe.parameters()))
        stepped[-1] = (stepped[-1], moved)
        pipe.scaler.update()
        scales.append(pipe.scaler.scale)
        opt.zero_grad()
    return {"first": first, "found": found, "stepped": stepped, "scales": scales}


def case_recompute(stages, gbs, mbs, recompute: Any, gpt: bool = False) -> list[dict]:
    """Activation recomputation (float64): the same loss and gradients as single-process training."""
    torch.manual_seed(0)
    model = _gpt(torch.float64) if gpt else Chain().double()
    loss_fn = lm_loss if gpt else F.cross_entropy
    pipe = dapple.pipeline(model, _plan(model, stages, gbs, mbs), loss_fn, timeout=30, recompute=recompute)
    out = []
    for step in range(2):
        x, y = _tokens(gbs, step) if gpt else _chain_data(gbs, seed=step)
        ref_loss, ref = _reference(model, loss_fn, x, y)
        out.append({**_compare(pipe, pipe.train_step(x, y), ref_loss, ref), "recompute": pipe.recompute})
        for p in pipe.parameters():
            p.grad = None
    return out


def case_recompute_batchnorm() -> str:
    torch.manual_seed(0)
    model = ResNet(widths=(4, 8), depth=1, num_classes=3, norm="batch").double()
    plan = _plan(model, [((0, 2), [0, 1]), ((2, 7), [2, 3])], 6, 3)
    try:
        dapple.pipeline(model, plan, F.cross_entropy, timeout=30, recompute=[False, True])
    except ValueError as e:
        return str(e)
    return "no error"


def _loss_error(wrong: Callable) -> dict[str, Any]:
    """Step 1 with the ``wrong`` loss raises on every rank; step 2, with the right loss, runs (the step's
    collectives had completed: the pipeline stays usable) and gives single-process training's loss and gradients."""
    torch.manual_seed(0)
    model = Chain().double()
    use = [wrong]
    pipe = dapple.pipeline(model, _plan(model, CHAIN_STAGES, 9, 3), lambda out, y: use[0](out, y), timeout=30)
    x, y = _chain_data(9)
    try:
        pipe.train_step(x, y)
        error = None
    except ValueError as e:
        error = str(e)
    grads = sorted(n for n, p in pipe.named_parameters() if p.grad is not None)
    use[0] = F.cross_entropy
    ref_loss, ref = _reference(model, F.cross_entropy, x, y)
    return {"error": error, "grads": grads, "then": _compare(pipe, pipe.train_step(x, y), ref_loss, ref)}


def case_summed_loss() -> dict[str, Any]:
    return _loss_error(lambda out, y: F.cross_entropy(out, y, reduction="sum"))


def case_loss_without_gradient() -> dict[str, Any]:
    return _loss_error(lambda out, y: F.cross_entropy(out.detach(), y))


def case_reduce_dtype() -> dict[str, Any]:
    """Gradient AllReduce in bf16 on a float64 chain whose middle stage is replicated: its gradients come back
    rounded to bf16's precision, the other stages' stay exact; and the gradients live in the buckets."""
    torch.manual_seed(0)
    model = Chain().double()
    pipe = dapple.pipeline(model, _plan(model, CHAIN_STAGES, 12, 3), F.cross_entropy, timeout=30,
                           reduce_dtype="bf16")
    x, y = _chain_data(12)
    ref_loss, ref = _reference(model, F.cross_entropy, x, y)
    res = _compare(pipe, pipe.train_step(x, y), ref_loss, ref)
    res["in_buckets"] = [pipe._reducer.holds(p.grad) for p in pipe.parameters() if p.grad is not None]
    return res


CASES: dict[str, tuple[Callable, tuple, dict]] = {
    "bf16": (case_bf16, (), {}),
    "fp16_overflow": (case_fp16_overflow, (), {}),
    "plan_bf16": (case_plan_precision, (None,), {}),
    "plan_bf16_run_fp32": (case_plan_precision, ("fp32",), {}),
    "recompute_all": (case_recompute, (CHAIN_STAGES, 9, 3, True), {}),
    "recompute_some_gpt": (case_recompute, (GPT_STAGES, 8, 4, [True, False, True]), {"gpt": True}),
    "recompute_modes_gpt": (case_recompute, (GPT_STAGES, 8, 4, ["layers", "selective", "layers"]), {"gpt": True}),
    "recompute_selective": (case_recompute, (CHAIN_STAGES, 9, 3, "selective"), {}),
    "recompute_batchnorm": (case_recompute_batchnorm, (), {}),
    "reduce_bf16": (case_reduce_dtype, (), {}),
    "summed_loss": (case_summed_loss, (), {}),
    "loss_without_gradient": (case_loss_without_gradient, (), {}),
}


def run_cases(cases: dict[str, tuple[Callable, tuple, dict]]) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {name: fn(*args, **kw) for name, (fn, args, kw) in cases.items()}
