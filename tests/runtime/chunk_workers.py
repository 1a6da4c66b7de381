"""Per-rank functions for the tests of ranks holding several chunks (gloo, float64): evaluation, what a rank holds,
checkpoints across plans with and without chunks."""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
import torch.nn.functional as F

import dapple
from dapple.models import GPT, lm_loss, random_tokens
from tests.runtime.workers import Chain, _chain_data, _plan

# GPT layers: wte, wpe, drop, blocks.0, blocks.1, ln_f, lm_head (lm_head tied to wte)
GPT_V = [((0, 2), [0, 1]), ((2, 4), [2, 3]), ((4, 5), [2, 3]), ((5, 7), [0, 1])]  # the tied weight on ranks 0, 1 only
GPT_STRAIGHT = [((0, 2), [0]), ((2, 4), [1]), ((4, 5), [2]), ((5, 7), [3])]
GPT_LOOP = [((0, 2), [0]), ((2, 4), [1, 2, 3]), ((4, 5), [0]), ((5, 7), [1, 2, 3])]


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=8).double()


def case_eval(stages: list, gbs: int, mbs: int, schedule: str, rows: int) -> dict:
    """eval_step on a batch of ``rows`` (not the plan's global batch): the loss of the model, the last stage's
    outputs row by row."""
    torch.manual_seed(0)
    model = Chain(depth=len(stages) - 1).double()
    pipe = dapple.pipeline(model, _plan(model, stages, gbs, mbs, schedule=schedule), F.cross_entropy, timeout=30)
    x, y = _chain_data(rows, seed=3)
    with torch.no_grad():
        out = copy.deepcopy(model).cpu()(x)
    loss, slices = pipe.eval_step(x, y, outputs=True)
    err = max([float((o - out[r.start:r.stop]).abs().max()) for r, o in slices], default=0.0)
    return {"loss": abs(loss - float(F.cross_entropy(out, y))), "outputs": err, "rows": sum(len(r) for r, _ in slices),
            "stages": pipe.stages, "data_stages": pipe.data.stages, "targets": pipe.data.targets}


def case_holdings(stages: list, schedule: str) -> dict:
    """What a rank of chunks holds: the names of its parameters (each once), its state_dict's keys."""
    model = _gpt()
    pipe = dapple.pipeline(model, _plan(model, stages, 6, 3, schedule=schedule), lm_loss, timeout=30)
    names = [n for n, _ in pipe.named_parameters()]
    return {"names": names, "params": len(list(pipe.parameters())), "keys": sorted(pipe.state_dict()),
            "repr": repr(pipe), "stages": pipe.stages}


def _pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _train(pipe: dapple.Pipeline, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        losses.append(pipe.train_step(*random_tokens(6, 8, 32, generator=torch.Generator().manual_seed(step))))
        opt.step()
        opt.zero_grad()
    return losses


def case_checkpoints(root: str) -> bytes:
    """Save after 2 AdamW steps under V chunks (the tied weight on one rank) and under straight stages; load the
    first under straight stages and under loop chunks (the tied weight across ranks), the second under V chunks:
    every parameter and optimizer state by name, to the bit; then one more step under each, from that state."""
    out: dict[str, Any] = {}
    plans = {"v": (GPT_V, "zb-v"), "straight": (GPT_STRAIGHT, "dapple"), "loop": (GPT_LOOP, "interleaved-1f1b")}
    for name in ("v", "straight"):
        stages, schedule = plans[name]
        model = _gpt()
        pipe = dapple.pipeline(model, _plan(model, stages, 6, 3, schedule=schedule), lm_loss, timeout=30)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        out[f"{name}_losses"] = _train(pipe, opt, range(2))
        dapple.save_checkpoint(f"{root}/{name}", pipe, opt)
        out[f"{name}_saved"] = _state(pipe, opt)
    for saved, name in (("v", "straight"), ("v", "loop"), ("straight", "v")):
        stages, schedule = plans[name]
        model = _gpt()
        pipe = dapple.pipeline(model, _plan(model, stages, 6, 3, schedule=schedule), lm_loss, timeout=30)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        dapple.load_checkpoint(f"{root}/{saved}", pipe, opt)
        out[f"{saved}->{name}"] = _state(pipe, opt)
        out[f"{saved}->{name}_loss"] = _train(pipe, opt, range(2, 3))
    return _pack(out)


def _state(pipe: dapple.Pipeline, opt: torch.optim.Optimizer) -> dict:
    """Parameters and AdamW state by name (copies)."""
    return {n: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
            for n, p in pipe.named_parameters()}


def full_reference() -> dict:
    """The single-process model's state after 2 AdamW steps on the same batches, and its third step's loss."""
    torch.set_default_dtype(torch.float64)
    try:
        return _train_reference()
    finally:  # (called in pytest's own process: later tests build float32 models)
        torch.set_default_dtype(torch.float32)


def _train_reference() -> dict:
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        if step == 2:
            state = {n: p.detach().clone() for n, p in model.named_parameters()}
        x, y = random_tokens(6, 8, 32, generator=torch.Generator().manual_seed(step))
        loss = lm_loss(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return {"params": state, "losses": losses}
