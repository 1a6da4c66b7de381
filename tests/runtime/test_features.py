"""Training features on 4 processes: bf16/fp16 autocast (activations on the wire in half precision, fp16's loss
scale decided once for every rank), activation recomputation (float64-exact), and the loss mistakes a step catches."""

from __future__ import annotations

import pytest

from tests.runtime import feature_workers as fw
from tests.runtime._spawn import run_ranks

TOL = 1e-9


@pytest.fixture(scope="module")
def results():
    return run_ranks(fw.run_cases, 4, fw.CASES, timeout=240)


@pytest.mark.slow
def test_bf16_is_autocast_with_half_the_bytes_on_the_wire(results):
    for rank, res in enumerate(r["bf16"] for r in results):
        # the same model and batch under single-process autocast: the slices and the wire's rounding differ
        assert res["loss"] < 1e-3, (rank, res["loss"])
        assert max(res["grads"].values()) < 0.05, (rank, res["grads"])
        assert res["vs_fp32"] > 1e-3  # autocast did change the reference's gradients: the comparison is not vacuous
        assert res["param_dtypes"] == ["torch.float32"] and res["grad_dtypes"] == ["torch.float32"]
        assert all(d.endswith("torch.bfloat16") for d in res["sent"]), (rank, res["sent"])
    assert any(r["bf16"]["sent"] for r in results)


@pytest.mark.slow
def test_a_plan_made_for_bf16_runs_in_bf16_unless_the_caller_says_fp32(results):
    for rank, r in enumerate(results):
        own, fp32 = r["plan_bf16"], r["plan_bf16_run_fp32"]
        assert all(d.endswith("torch.bfloat16") for d in own["sent"]), (rank, own)
        assert own["warned"] == []
        assert all(d.endswith("torch.float32") for d in fp32["sent"]), (rank, fp32)
        # rank 0 says the plan's estimates assumed bf16
        assert len(fp32["warned"]) == (rank == 0) and all("made for bf16" in w for w in fp32["warned"]), fp32
    assert any(r["plan_bf16"]["sent"] for r in results) and any(r["plan_bf16_run_fp32"]["sent"] for r in results)


@pytest.mark.slow
def test_fp16_skips_an_overflowing_step_on_every_rank(results):
    for rank, res in enumerate(r["fp16_overflow"] for r in results):
        assert res["first"]["loss"] < 1e-3 and max(res["first"]["grads"].values()) < 0.05, (rank, res["first"])
        assert res["found"] == [False, True, False], rank  # rank 2 overflowed: every rank knows it
        assert res["stepped"] == [(True, True), (False, False), (True, True)], rank
        assert res["scales"] == [65536.0, 65536.0, 32768.0, 32768.0], rank


@pytest.mark.slow
@pytest.mark.parametrize("case, flags", [("recompute_all", [True] * 4),
                                         ("recompute_some_gpt", [True, True, False, True]),
                                         ("recompute_modes_gpt", ["layers", "layers", "selective", "layers"]),
                                         ("recompute_selective", ["selective"] * 4)])
def test_recomputation_is_exact(results, case, flags):
    """Whole stages, layer by layer and selective: the loss and gradients of single-process training (float64)."""
    for rank, per_step in enumerate(r[case] for r in results):
        for res in per_step:
            assert res["loss"] <= TOL and all(e <= TOL for e in res["grads"].values()), (case, rank, res)
    assert [r[case][0]["recompute"] for r in results] == flags


@pytest.mark.slow
def test_recomputing_a_stage_with_batch_norm_is_refused(results):
    for r in results:
        assert "recompute: stage 1 holds batch normalisation" in r["recompute_batchnorm"], r["recompute_batchnorm"]


@pytest.mark.slow
@pytest.mark.parametrize("case, says", [("summed_loss", "loss_fn returned the sum over the rows"),
                                        ("loss_without_gradient", "the loss does not require grad")])
def test_a_wrong_loss_makes_every_rank_raise_and_the_pipeline_goes_on(results, case, says):
    for rank, res in enumerate(r[case] for r in results):
        assert res["error"] is not None and says in res["error"], (rank, res["error"])
        assert "step 1" in res["error"] and "gradients were discarded" in res["error"]
        assert res["grads"] == [], rank  # the step's gradients were discarded
        # the step's collectives had completed: the pipeline stays usable, and the next step is exact
        then = res["then"]
        assert then["loss"] <= TOL and all(e <= TOL for e in then["grads"].values()), (rank, then)


@pytest.mark.slow
def test_reduce_dtype_bf16_rounds_only_the_reduced_gradients_which_live_in_the_buckets(results):
    for rank, res in enumerate(r["reduce_bf16"] for r in results):
        assert res["loss"] <= TOL, (rank, res)
        worst = max(res["grads"].values())
        if res["stage"] == 1:  # replicated: summed in bf16 (8 bits of mantissa), written back in float64
            assert 1e-6 < worst < 1e-2, (rank, res["grads"])
            assert res["in_buckets"] and all(res["in_buckets"]), rank  # no second copy of the gradients
        else:
            assert worst <= TOL and not any(res["in_buckets"]), (rank, res["grads"])  # no AllReduce: plain grads

