"""torch.compile of each stage on 2 processes: the same losses and gradients as eager (float64, also recomputing layer
by layer and selectively), recompiling for a new shape and a train/eval switch as torch.compile does, and zb-h1
refused with the reason."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import dapple
from dapple.models import lm_loss
from tests.runtime._spawn import run_ranks
from tests.runtime.feature_workers import _gpt
from tests.runtime.workers import _plan

STAGES = [((0, 4), [0]), ((4, 7), [1])]  # wte .. h.0 | h.1, ln_f, the tied lm_head


def case_compile() -> dict[str, Any]:
    """The GPT compiled (aot_eager: AOTAutograd's graphs run eagerly) against the same pipeline eager: two steps at
    two sequence lengths, then an evaluation; and how often a counting backend compiled."""
    compiled: list[str] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compiled.append(f"{len(example_inputs)} inputs")
        return gm.forward
    out: dict[str, Any] = {}
    runs = {}
    options = (("eager", False), ("aot_eager", {"backend": "aot_eager"}), ("counting", {"backend": counting}))
    for name, option in options:
        model = _gpt(torch.float64)
        pipe = dapple.pipeline(model, _plan(model, STAGES, 8, 4), lm_loss, timeout=60, compile=option)
        losses = []
        for seq in (8, 6):
            x, y = dapple.models.random_tokens(8, seq, 32, generator=torch.Generator().manual_seed(seq))
            losses.append(pipe.train_step(x, y))
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
        pipe.eval()
        losses.append(pipe.eval_step(x, y))
        pipe.train()
        losses.append(pipe.train_step(x, y))
        runs[name] = (losses, grads, type(pipe._runner.forward_module).__name__)
    (loss0, grads0, _), (loss1, grads1, kind) = runs["eager"], runs["aot_eager"]
    out["loss"] = max(abs(a - b) for a, b in zip(loss0, loss1))
    out["grads"] = max(float((grads0[n] - grads1[n]).abs().max()) for n in grads0)
    out["kind"], out["compiled"] = kind, compiled
    out["recomputed"] = _recomputed_compiled()
    try:
        model = _gpt(torch.float64)
        dapple.pipeline(model, _plan(model, STAGES, 8, 4, schedule="zb-h1"), lm_loss, timeout=60, compile=True)
        out["zb"] = "no error"
    except ValueError as e:
        out["zb"] = str(e)
    return out


def _recomputed_compiled() -> dict[str, float]:
    """A step with stage 0 recomputing layer by layer and stage 1 selectively, compiled (aot_eager) and eager: the
    largest loss and gradient differences (float64)."""
    got = []
    for option in (False, {"backend": "aot_eager"}):
        model = _gpt(torch.float64)
        pipe = dapple.pipeline(model, _plan(model, STAGES, 8, 4), lm_loss, timeout=60, compile=option,
                               recompute=["layers", "selective"])
        x, y = dapple.models.random_tokens(8, 8, 32, generator=torch.Generator().manual_seed(3))
        got.append((pipe.train_step(x, y), {n: p.grad.clone() for n, p in pipe.named_parameters()
                                            if p.grad is not None}))
    (l0, g0), (l1, g1) = got
    return {"loss": abs(l0 - l1), "grads": max(float((g0[n] - g1[n]).abs().max()) for n in g0)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(case_compile, 2, timeout=240)


@pytest.mark.slow
def test_a_compiled_pipeline_trains_and_evaluates_as_the_eager_one_and_recompiles_as_torch_does(results):
    for rank, res in enumerate(results):
        assert res["kind"] == "OptimizedModule", rank
        assert res["loss"] < 1e-12 and res["grads"] < 1e-12, (rank, res)
        # train at seq 8, a new shape (seq 6), the evaluation twin, then training again: at least three graphs
        assert len(res["compiled"]) >= 3, (rank, res["compiled"])
        assert "splits each backward" in res["zb"] and "schedule 'dapple'" in res["zb"], res["zb"]


def test_compile_options_are_checked_before_any_work():
    from dapple.runtime.compiling import stage_compiler
    assert stage_compiler(False, "zb-h1", [False]) is None
    assert stage_compiler(True, "zb-h1", [True, True]) is not None  # recomputing stages run their backward in B
    with pytest.raises(TypeError, match="compile: expected True, False or a dict"):
        stage_compiler("max-autotune", "dapple", [False])
    with pytest.raises(ValueError, match="schedule 'zb-h1' splits each backward"):
        stage_compiler({"backend": "aot_eager"}, "zb-h1", [True, False])


@pytest.mark.slow
def test_compiled_stages_recompute_layer_by_layer_and_selectively_as_eager(results):
    for rank, res in enumerate(r["recomputed"] for r in results):
        assert res["loss"] < 1e-12 and res["grads"] < 1e-12, (rank, res)
