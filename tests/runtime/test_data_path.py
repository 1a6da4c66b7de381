"""Per-rank loading on 4 processes (gloo, float64): each rank passes only its own rows of what it reads (None
elsewhere) and gets the global-batch call's loss, gradients and evaluation bit for bit; per-rank mistakes make
every rank raise before anything runs; a loader reads each row once per stage that reads it."""

from __future__ import annotations

import pytest

from tests.runtime import data_workers as dw
from tests.runtime._spawn import run_ranks

TOL = 1e-9
PER_RANK = [k for k, (fn, _, _) in dw.CASES.items() if fn is dw.case_per_rank]


@pytest.fixture(scope="module")
def results():
    return run_ranks(dw.run_cases, 4, dw.CASES, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("case", PER_RANK)
def test_own_rows_give_the_global_batch_calls_loss_and_gradients_exactly(results, case):
    for rank, res in enumerate(r[case] for r in results):
        assert res["same_loss"] and res["same_grads"] == res["names"] and res["names"], (case, rank, res)
        assert res["same_eval"], (case, rank)  # eval_step(..., batch_size=) on own rows: loss and outputs
        assert res["loss"] <= TOL and all(e <= TOL for e in res["grads"].values()), (case, rank, res)
        assert res["step"] == 2, (case, rank)
    seen = set().union(*(r[case]["names"] for r in results))
    assert seen == set(results[0][case]["expected"]), case


@pytest.mark.slow
def test_a_rank_passes_none_for_what_it_does_not_read(results):
    passed = {case: [r[case]["passed"] for r in results] for case in PER_RANK}
    # (rows per input given, rows per target given); None: nothing passed
    assert passed["first_replicated"] == [([6], None), ([3], None), (None, None), (None, [9])]  # a middle stage
    assert passed["last_replicated"] == [([8], None), (None, None), (None, [4]), (None, [4])]
    assert passed["two_by_two_uneven"] == [([9], None), ([6], None), (None, [9]), (None, [6])]
    # TwoInputs: x read by stage 0, z by stage 1 (h * z follows layer b there), two targets (weighted_loss)
    assert passed["later_stage_reads_input"] == [([8, None], None), ([None, 8], None), (None, [4, 4]),
                                                 (None, [4, 4])]
    # GPT with the embedding alone: stage 1's position ids read the token ids too
    assert passed["later_stage_reads_ids"] == [([8], None), ([4], None), ([4], None), (None, [8])]


@pytest.mark.slow
def test_a_wrong_per_rank_batch_makes_every_rank_raise_naming_it(results):
    for rank, res in enumerate(r["mistakes"] for r in results):
        short, other, missing = (res["errors"][k] for k in ("short", "other_rows", "missing"))
        expected = ("inputs[0] has shape (3, 8); expected the global batch of 8 rows (plan.global_batch_size) in "
                    "dimension 0, split into 2 micro-batches of 4, or this rank's own 4 rows (pipe.rows(): rows "
                    "0:2 of each micro-batch, in order)")
        assert short == f"ValueError: {expected}" if rank == 1 else short.endswith(
            f"another rank's batch was refused, so no rank runs this step: rank 1 (stage 1): ValueError: "
            f"{expected}"), (rank, short)
        # rank 1's rows differ from rank 0's copy of the same rows (rank 0 holds all: stage 0 is not replicated)
        assert other is not None and "the ranks were given different inputs of the same shapes" in other, other
        assert "input 0 ('idx'), rows [0, 2) of every micro-batch: ranks with equal values: [[0], [1]]" in other
        assert missing is not None and "inputs is None, but rank 2 (stage 1) reads input 0 ('idx')" in missing
        assert res["step"] == 1, rank  # the refused steps did not count
        after = res["after"]  # then ranks 0 and 3 pass the global inputs, ranks 1-3 the global targets: fine
        assert after["loss"] <= TOL and all(e <= TOL for e in after["grads"].values()), (rank, after)


@pytest.mark.slow
def test_a_loader_reads_each_row_once_per_stage_that_reads_it(results):
    out = [r["loader"] for r in results]
    for rank, res in enumerate(out):
        for step in res["steps"]:  # each step equals single-process training on its global batch
            assert step["loss"] <= TOL and all(e <= TOL for e in step["grads"].values()), (rank, step)
    batches = out[0]["batches"]
    assert all(r["batches"] == batches for r in out)  # the same permutation on every rank
    for epoch in range(2):
        used = sorted(i for b in batches[3 * epoch:3 * epoch + 3] for i in b)  # 3 steps of 6 rows out of 20
        assert len(used) == 18 and len(set(used)) == 18
        assert sorted(out[0]["reads"][epoch] + out[1]["reads"][epoch]) == used  # stage 0's replicas split them
        assert out[2]["reads"][epoch] == []  # the middle stage reads nothing
        assert sorted(out[3]["reads"][epoch]) == used  # the last stage (not replicated) reads each once
    assert batches[:3] != batches[3:]  # set_epoch: another permutation
    for rank, res in enumerate(out):  # eval_step(*batch) of a loader: batch_size says the rows are the rank's own
        assert len(res["eval"]) == 3 and all(own == whole for own, whole in res["eval"]), (rank, res["eval"])


@pytest.mark.slow
def test_ranks_whose_loaders_draw_different_orders_all_raise(results):
    """Rank 3 (the labels) shuffles with another seed than ranks 0 and 1 (the images): no two ranks hold the same
    tensor's rows, but they hold the same batch rows' dataset ids."""
    for rank, res in enumerate(r["loader"] for r in results):
        assert res["desync"] is not None and (
            "the ranks loaded different dataset rows (ids) for the same rows of the batch: rows [0, 2) of every "
            "micro-batch: ranks with equal ids: [[0], [3]]") in res["desync"], (rank, res["desync"])
        assert res["step"] == 6, rank  # 2 epochs of 3 steps; the refused step did not count
