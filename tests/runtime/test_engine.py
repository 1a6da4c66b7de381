"""Transparency on 4 processes (gloo, float64): loss and every gradient equal single-process training, for
every plan shape; activations alive bounded by K_i whatever M (dapple) but not under gpipe."""

from __future__ import annotations

import pytest

from tests.runtime import workers
from tests.runtime._spawn import run_ranks

TOL = 1e-9
NOT_SHAPES = ("memory", "owned", "inputs_differ", "no_gradient", "shards", "repeatable")
SHAPES = [k for k in workers.CASES_4 if k not in NOT_SHAPES]


def assert_transparent(results: list[dict], shape: str) -> list[list[dict]]:
    """Loss and every gradient within TOL of single-process training on every rank and step, and every parameter of
    the model checked on some rank; returns the case's results per rank, per step."""
    steps = [r[shape] for r in results]
    for rank, per_step in enumerate(steps):
        for step, res in enumerate(per_step):
            assert res["loss"] <= TOL, (shape, rank, step, res["loss"])
            bad = {n: e for n, e in res["grads"].items() if not e <= TOL}
            assert not bad, (shape, rank, step, bad)
    for step in range(len(steps[0])):
        seen = set().union(*(set(r[step]["grads"]) for r in steps))
        assert seen == set(steps[0][step]["expected"]), shape
    return steps


@pytest.fixture(scope="module")
def results():
    """All cases, run once on one world of 4 ranks (spawning is the expensive part)."""
    return run_ranks(workers.run_cases, 4, workers.CASES_4, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_pipeline_equals_single_process(results, shape):
    steps = assert_transparent(results, shape)
    for step in range(len(steps[0])):  # replicas of a stage hold the same names
        by_stage: dict[int, set] = {}
        for r in steps:
            names = set(r[step]["grads"])
            assert by_stage.setdefault(r[step]["stage"], names) == names


@pytest.mark.slow
def test_gradient_allreduce_overlaps_the_last_backward(results):
    for rank, per_step in enumerate(r["pure_dp_4"] for r in results):
        for res in per_step:
            buckets, early = res["buckets"]
            assert buckets > 0 and early == buckets, (rank, res["buckets"])  # all launched by backward hooks


@pytest.mark.slow
def test_gradient_buckets_reuse_one_flat_buffer_across_steps(results):
    for rank, per_step in enumerate(r["pure_dp_4"] for r in results):
        first, second = (res["flat"] for res in per_step)
        assert first and None not in first and first == second, rank  # allocated once, kept for later steps


@pytest.mark.slow
def test_activation_memory_bounded_by_warmup_not_micro_batches(results):
    """Saved-for-backward bytes per rank (straight 4 stages, policy A: K = 4, 3, 2, 1) at M = 4 and 8."""
    for rank, peaks in enumerate(r["memory"] for r in results):
        per_micro_batch = peaks["gpipe/4"] / 4  # gpipe holds all M micro-batches at once
        assert per_micro_batch > 0, (rank, peaks)  # the meter saw the activations
        assert peaks["gpipe/8"] == pytest.approx(8 * per_micro_batch, rel=0.02), (rank, peaks)
        k = 4 - rank
        for m in (4, 8):  # dapple holds K_i of them, whatever M
            assert peaks[f"dapple/{m}"] == pytest.approx(k * per_micro_batch, rel=0.02), (rank, m, peaks)


@pytest.mark.slow
def test_each_rank_keeps_only_its_stage(results):
    for rank, owned in enumerate(r["owned"] for r in results):
        assert owned["alive"] == owned["mine"] and owned["mine"], (rank, owned)
    assert "wte.weight" in results[3]["owned"]["mine"]  # the tied head, under its first name


@pytest.mark.slow
def test_ranks_given_inputs_of_different_shapes_all_raise_before_any_transfer(results):
    for rank, out in enumerate(r["inputs_differ"] for r in results):
        assert out["error"] is not None and out["error"].startswith(
            f"rank {rank} (stage {[0, 0, 1, 2][rank]}), step 1: the ranks were given inputs of "
            "different shapes or dtypes"), (rank, out["error"])
        assert "rank 2: [([8], 'torch.int64')]; rank 3: [([5], 'torch.int64')]" in out["error"], out["error"]
        # nothing was in flight: the next step, with the same batch everywhere, is step 1 and is exact
        assert out["step"] == 1 and out["after"]["loss"] <= TOL, (rank, out)
        assert all(e <= TOL for e in out["after"]["grads"].values()), (rank, out["after"])


@pytest.mark.slow
def test_clip_grad_norm_is_the_single_process_norm_on_every_rank(results):
    """The clipped gradients are checked with every shape above; here the returned total norm, which counts a
    replicated stage and the tied embedding/head weight once, on every rank, clipped or not."""
    for rank, per_case in enumerate(r["clip_grad_norm"] for r in results):
        assert [res["clipped"] for res in per_case] == [True, True, False]
        for res in per_case:
            assert res["norm"] <= TOL, (rank, res["norm"])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["seeds_differ", "seeds_differ_tied"])
def test_replicas_and_tied_copies_start_from_their_roots_values(results, case):
    """Ranks that built the model from different seeds: each replica and tied copy holds its root's values after
    dapple.pipeline (the step's equality with single-process training is checked with the shapes above)."""
    for rank, (res,) in enumerate(r[case] for r in results):
        assert res["unequal"] == [], (rank, res["unequal"])
        assert res["differed"], rank  # the seeds did give the ranks different models


@pytest.mark.slow
def test_parameters_without_gradients_keep_grad_none_as_on_one_device(results):
    for rank, (res,) in enumerate(r["no_gradient"] for r in results):
        assert res["none_expected"], rank  # every stage holds a gain that gets no gradient
        assert res["none"] == res["none_expected"], rank
        assert res["moved"] == [], rank  # AdamW's weight decay moved none of them (single-process did not)


@pytest.mark.slow
def test_ranks_given_their_own_shards_all_raise_naming_what_differs(results):
    for rank, res in enumerate(r["shards"] for r in results):
        inputs, targets = res["errors"]
        assert inputs is not None and "step 1: the ranks were given different inputs of the same shapes" in inputs
        assert "not its own shard" in inputs and "[[0], [1], [2], [3]]" in inputs, inputs
        assert targets is not None and "step 1: the ranks were given different targets" in targets, targets
        assert res["step"] == 1, rank  # the refused steps did not count; the correct one ran
        assert res["after"]["loss"] <= TOL and all(e <= TOL for e in res["after"]["grads"].values()), rank


@pytest.mark.slow
def test_the_same_seed_and_plan_give_the_same_losses_run_after_run(results):
    for rank, res in enumerate(r["repeatable"] for r in results):
        assert res["first"] == res["again"], rank  # bit for bit
        assert res["first"] != res["other"], rank  # dropout is on: another seed, other masks
