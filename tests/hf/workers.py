"""Per-rank work for the Hugging Face tests: each model pipelined on 4 ranks (stages of 1, 2 and 1 replicas) and
trained, evaluated and read back against single-process float64 runs of the same model."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any, Iterator

import torch

import dapple
from dapple.planner import Plan, Stage
from tests.hf.models import CASES, Case

GLOBAL, MICRO = 8, 4  # 2 micro-batches; the replicated stage splits each into 2 rows + 2 rows
LENGTHS = (8, 5)  # sequence length (image size for the CNN) of step 1 and step 2


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, the same relative to the largest reference value, or to 1e-6 if that is smaller: a
    gradient that is zero in exact arithmetic, as a key bias's, is rounding noise of ~1e-23)."""
    diff = float((got.detach().cpu() - want).abs().max()) if want.numel() else 0.0
    return diff, diff / max(float(want.abs().max()) if want.numel() else 0.0, 1e-6)


def _reference_step(ref: torch.nn.Module, case: Case, xs: tuple, ys: tuple) -> tuple[float, dict]:
    """One process: loss and gradients of the global batch (BatchNorm: as deferred_batch_norm updates it)."""
    if case.sliced is None:
        loss = case.loss_fn(ref(*xs), *ys)
        loss.backward()
    else:
        with _statistics_of_the_step(ref):  # (updated after the backward, which needs them as they were)
            loss = case.loss_fn(case.sliced(ref, *xs), *ys)
            loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


@contextmanager
def _statistics_of_the_step(model: torch.nn.Module) -> Iterator[None]:
    """BatchNorm running statistics updated once, with the mean and unbiased variance of every row each layer saw
    in the block (as one forward over all of them would), not once per call."""
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    seen: dict[torch.nn.Module, list[torch.Tensor]] = {b: [] for b in bns}
    hooks = [b.register_forward_pre_hook(lambda m, args: seen[m].append(args[0].detach())) for b in bns]
    saved = [(b, b.momentum, b.num_batches_tracked.clone()) for b in bns]
    for b in bns:
        b.momentum = 0.0  # the calls normalise by their own rows and leave the running statistics alone
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for b, momentum, count in saved:
            rows = torch.cat(seen[b]).transpose(0, 1).flatten(1)  # (C, all rows x H x W)
            b.momentum = momentum
            with torch.no_grad():
                b.running_mean.mul_(1 - momentum).add_(rows.mean(1), alpha=momentum)
                b.running_var.mul_(1 - momentum).add_(rows.var(1), alpha=momentum)
                b.num_batches_tracked.copy_(count + 1)


def _compare_step(pipe: dapple.Pipeline, loss: float, ref_loss: float, ref_grads: dict) -> dict[str, Any]:
    grads = {n: _errors(p.grad if p.grad is not None else torch.zeros_like(p), ref_grads[n])
             for n, p in pipe.named_parameters()}
    return {"loss": (abs(loss - ref_loss), abs(loss - ref_loss) / abs(ref_loss)), "grads": grads}


def _plan(layers: int, cuts: tuple[int, int]) -> Plan:
    """No layer names: the pipeline groups the model by the default rule (tests/hf/test_profile.py checks them)."""
    a, b = cuts
    return Plan(GLOBAL, MICRO, [Stage((0, a), [0]), Stage((a, b), [1, 2]), Stage((b, layers), [3])])


def run_case(case: Case) -> dict[str, Any]:
    """Two SGD steps (the second at another sequence length), then an evaluation and the state, each compared
    with the same model run in one process."""
    torch.manual_seed(0)
    model = case.make().double()
    gen = torch.Generator().manual_seed(1)
    example = case.batch(2, LENGTHS[0], gen)[0]
    ref = copy.deepcopy(model)
    pipe = dapple.pipeline(model, _plan(len(case.layers), case.cuts), case.loss_fn, timeout=60, example_inputs=example,
                           tracer=case.tracer, leaf_modules=case.leaf_modules,
                           deferred_batch_norm=case.sliced is not None)
    pipe.train(case.train_mode)
    ref.train(case.train_mode)
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    out: dict[str, Any] = {"steps": [], "stage": pipe.stage,
                           "params": [n for n, _ in ref.named_parameters()]}
    for length in LENGTHS:
        xs, ys = case.batch(GLOBAL, length, gen)
        ref_loss, ref_grads = _reference_step(ref, case, xs, ys)
        out["steps"].append(_compare_step(pipe, pipe.train_step(xs, ys), ref_loss, ref_grads))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    out["eval"] = _evaluate(pipe, ref, case, gen)
    out["state"] = _state(pipe, ref)
    return out


def _evaluate(pipe: dapple.Pipeline, ref: torch.nn.Module, case: Case, gen: torch.Generator) -> dict[str, Any]:
    """eval_step of 3 micro-batches (not the plan's global batch) in eval mode, loss and outputs; then in train
    mode (BatchNorm updates its statistics; the model with dropout gets another loss), then in eval mode again."""
    xs, ys = case.batch(3 * MICRO, LENGTHS[0], gen)
    pipe.eval()
    ref.eval()
    with torch.no_grad():
        ref_out = ref(*xs)
        ref_loss = float(case.loss_fn(ref_out, *ys))
    loss, slices = pipe.eval_step(xs, ys, outputs=True)
    logits = ref_out.logits if hasattr(ref_out, "logits") else ref_out
    outputs = [_errors(o.logits if hasattr(o, "logits") else o, logits[rows.start:rows.stop])[1]
               for rows, o in slices]
    result = {"loss": (abs(loss - ref_loss), abs(loss - ref_loss) / abs(ref_loss)), "outputs": outputs,
              "rows": sorted(r for rows, _ in slices for r in rows),
              "no_grad": all(p.grad is None for p in pipe.parameters())}
    pipe.train()
    ref.train()
    train_loss = pipe.eval_step(xs, ys)
    with torch.no_grad():
        ref_train = _reference_forward(ref, case, xs, ys) if case.train_mode else loss
    result["train_mode"] = (train_loss, abs(train_loss - ref_train) / abs(ref_train))
    pipe.eval()
    ref.eval()
    with torch.no_grad():
        ref_loss = float(case.loss_fn(ref(*xs), *ys))
    result["eval_again"] = abs(pipe.eval_step(xs, ys) - ref_loss) / abs(ref_loss)
    return result


def _reference_forward(ref: torch.nn.Module, case: Case, xs: tuple, ys: tuple) -> float:
    if case.sliced is None:
        return float(case.loss_fn(ref(*xs), *ys))
    with _statistics_of_the_step(ref):
        return float(case.loss_fn(case.sliced(ref, *xs), *ys))


def _state(pipe: dapple.Pipeline, ref: torch.nn.Module) -> dict[str, Any]:
    """This stage's state_dict against the reference's (after the same steps: BatchNorm statistics included), and
    a load of the whole reference state_dict (strict: keys of other stages are skipped)."""
    full = ref.state_dict()
    mine = pipe.state_dict()
    errors = {k: _errors(v.double(), full[k].double())[1] for k, v in mine.items() if v.is_floating_point()}
    counts = {k: int(v) for k, v in mine.items() if k.endswith("num_batches_tracked")}
    shifted = {k: v + 1 if v.is_floating_point() else v for k, v in full.items()}
    missing, unexpected = pipe.load_state_dict(shifted)
    moved = all(torch.equal(v.cpu(), shifted[k]) for k, v in pipe.state_dict().items())
    pipe.load_state_dict(full)
    return {"keys": list(mine), "all_keys": list(full), "errors": errors, "counts": counts,
            "ref_counts": {k: int(full[k]) for k in counts}, "loaded": (missing, unexpected, moved)}


def run_all() -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    return {name: run_case(case) for name, case in CASES.items()}
