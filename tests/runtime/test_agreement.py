"""Ranks given different plans, models or options: every rank raises at dapple.pipeline, naming the ranks that differ
and in what, before any group or transfer; the same plan everywhere then trains as one process would (4 ranks)."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import dapple
from dapple.runtime.agreement import Description, describe
from tests.runtime._spawn import run_ranks
from tests.runtime.workers import Chain, _chain_data, _compare, _plan, _reference

STAGES = [((0, 1), [0]), ((1, 3), [1, 2]), ((3, 5), [3])]
OTHER_CUT = [((0, 1), [0]), ((1, 4), [1, 2]), ((4, 5), [3])]  # block 3 on stage 1 too: it would run twice
K = [((0, 1), [0], 3), ((1, 3), [1, 2], 2), ((3, 5), [3], 1)]
OTHER_K = [((0, 1), [0], 2), ((1, 3), [1, 2], 2), ((3, 5), [3], 1)]


def _build(model: torch.nn.Module, stages: list, mbs: int = 2, **kw: Any) -> str:
    try:
        dapple.pipeline(model, _plan(model, stages, 12, mbs), F.cross_entropy, timeout=30, **kw)
    except ValueError as e:
        return str(e)
    return "no error"


def mismatches() -> dict[str, Any]:
    """Each case gives one rank something else; then every rank builds the same pipeline and trains a step."""
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = Chain().double()
    out = {
        "cut": _build(model, OTHER_CUT if rank == 2 else STAGES),
        "micro_batch": _build(model, STAGES, mbs=3 if rank == 1 else 2),
        "warmup": _build(model, OTHER_K if rank == 0 else K),
        "width": _build(Chain(width=8).double() if rank == 3 else model, STAGES),
        "options": _build(model, STAGES, mixed_precision="bf16" if rank in (1, 3) else None),
    }
    pipe = dapple.pipeline(model, _plan(model, STAGES, 12, 2), F.cross_entropy, timeout=30)
    x, y = _chain_data(12)
    ref_loss, ref = _reference(model, F.cross_entropy, x, y)
    out["after"] = _compare(pipe, pipe.train_step(x, y), ref_loss, ref)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(mismatches, 4, timeout=180)


SAYS = {
    "cut": "rank 2's plan differs from rank 0's (as on ranks [0, 1, 3]) in stages[1].layers: [1, 4) vs [1, 3), "
           "stages[2].layers: [4, 5) vs [3, 5)",
    "micro_batch": "rank 1's plan differs from rank 0's (as on ranks [0, 2, 3]) in micro_batch_size: 3 vs 2",
    "warmup": "rank 0's plan differs from rank 1's (as on ranks [1, 2, 3]) in stages[0].warmup: 2 vs 3",
    "width": "rank 3's model's tensor list differs from rank 0's (as on ranks [0, 1, 2]) in blocks.0.0.weight: "
             "(8, 8) float64 vs (6, 6) float64, blocks.0.0.bias: (8,) float64 vs (6,) float64",
    "options": "ranks [1, 3]'s options differs from rank 0's (as on ranks [0, 2]) in mixed_precision: bf16 vs None",
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SAYS))
def test_a_rank_given_something_else_makes_every_rank_raise_naming_it(results, case):
    for rank, r in enumerate(results):
        msg = r[case]
        assert msg.startswith("dapple.pipeline: the ranks were not all given the same plan, model and options: "), msg
        assert SAYS[case] in msg, (rank, msg)


@pytest.mark.slow
def test_the_same_plan_everywhere_then_trains_as_one_process(results):
    for rank, r in enumerate(results):
        res = r["after"]
        assert res["loss"] <= 1e-12 and all(e <= 1e-12 for e in res["grads"].values()), (rank, res)


def test_what_is_compared_and_what_is_not():
    """The plan's stages, micro-batching, schedule and layer names, the model's tensors, the options; not the
    plan's meta or estimate (they change nothing that runs)."""
    model = Chain().double()
    plan = _plan(model, K, 12, 2)
    names = ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]

    def of(p, m=model, **kw: Any) -> Description:
        opts = {"mixed_precision": None, "recompute": [False] * 3, "loss_fn": F.cross_entropy,
                "options": {"deferred_batch_norm": False, "check_inputs": True, "tracer": "auto"}, **kw}
        return describe(p, m, names, ["x"], precision=opts["mixed_precision"], recompute=opts["recompute"],
                        loss_fn=opts["loss_fn"], options=opts["options"])

    base = of(plan)
    assert base.sections["plan"]["stages[1].layers"] == "[1, 3)" and base.sections["plan"]["stages[0].warmup"] == "3"
    assert base.sections["model's tensor list"]["head.weight"] == "(3, 6) float64"
    assert base.sections["options"]["loss_fn"] == "torch.nn.functional.cross_entropy"
    noted = _plan(model, K, 12, 2)
    noted.meta["note"] = "made on another day"
    assert of(noted).digests() == base.digests()
    for other in (of(_plan(model, K, 12, 2, schedule="gpipe")), of(plan, recompute=[True, False, False]),
                  of(plan, loss_fn=F.mse_loss), of(plan, m=Chain().float()), of(_plan(model, K, 24, 2))):
        assert other.digests() != base.digests()


def _one_rank_fails(_: Any) -> tuple[str, float]:
    """Rank 1 fails its own checks before the agreement (a recompute list of the wrong length): what each rank
    raised, and after how long."""
    model = Chain().double()
    t0 = time.monotonic()
    try:
        plan = _plan(model, [((0, 1), [0]), ((1, 3), [1]), ((3, 5), [2])], 12, 2)
        dapple.pipeline(model, plan, F.cross_entropy, timeout=30,
                        recompute=[True] if int(os.environ["RANK"]) == 1 else None)
    except (ValueError, dapple.runtime.PipelineError) as e:
        return f"{type(e).__name__}: {e}", time.monotonic() - t0
    return "no error", time.monotonic() - t0


@pytest.mark.slow
def test_a_rank_failing_before_the_agreement_is_named_on_every_rank_at_once():
    got = run_ranks(_one_rank_fails, 3, None, timeout=120)
    assert got[1][0].startswith("ValueError: recompute: expected None (the plan's), one of (False, True, 'layers', "
                                "'selective') or one of them per stage (3), got [True]"), got[1]
    for rank in (0, 2):
        msg, seconds = got[rank]
        assert msg == (f"PipelineError: rank {rank}: dapple.pipeline: rank 1 failed building its pipeline: "
                       f"{got[1][0]}"), msg
        assert seconds < 20, (rank, seconds)  # told at once, not after the 30 s timeout
