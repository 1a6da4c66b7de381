"""Ranks holding several chunks (interleaved-1f1b in the loop order, zb-v in the V order) on 4 processes (gloo,
float64): loss and every gradient equal single-process training for replicated chunks, relays, a parameter tied
between chunks of one rank and across ranks, a device group of every rank; evaluation; what a rank holds;
checkpoints saved and loaded across plans with and without chunks, to the bit."""

from __future__ import annotations

import pytest
import torch

from tests.runtime import chunk_workers, workers
from tests.runtime._spawn import run_ranks
from tests.runtime.test_engine import assert_transparent

TOL = 1e-9
V, LOOP = "zb-v", "interleaved-1f1b"
ONE, THREE, PAIR, OTHER = [0], [1, 2, 3], [0, 1], [2, 3]  # device groups: a single rank, three replicas, pairs
CHAINS = {  # Chain(depth) cases: (stages, global batch, micro-batch, depth, schedule)
    "v_chain_1_and_3_replicas": ([((0, 1), ONE), ((1, 3), THREE), ((3, 4), THREE), ((4, 5), ONE)], 9, 3, 4, V),
    "v_one_device_group": ([((0, 1), [0, 1, 2, 3]), ((1, 2), [0, 1, 2, 3])], 8, 4, 1, V),  # every hand-off local
    "loop_three_chunks_short_round": ([((i, i + 1), ONE if i % 2 == 0 else THREE) for i in range(6)], 15, 3, 5,
                                      LOOP),  # M = 5: rounds of 2, 2, 1
}
CASES = {name: (workers.case_chain, (stages, gbs, mbs), {"steps": 2, "depth": d, "schedule": sch})
         for name, (stages, gbs, mbs, d, sch) in CHAINS.items()}
CASES.update(workers.with_schedule({  # Skip: a value relayed through the chunks (across a hand-off on the V)
    "v_skip_relayed": (workers.case_skip, ([((0, 1), PAIR), ((1, 2), OTHER), ((2, 3), OTHER), ((3, 4), PAIR)], 8, 2),
                       {}),
    "v_gpt_tied_on_one_rank": (workers.case_gpt, (chunk_workers.GPT_V, 6, 3), {"seqs": (8, 5)}),
    "v_clip_tied_on_one_rank": (workers.case_clip, (chunk_workers.GPT_V, 6, 3), {})}, V))
CASES.update(workers.with_schedule({
    "loop_skip_relayed": (workers.case_skip, ([((0, 1), ONE), ((1, 2), THREE), ((2, 3), ONE), ((3, 4), THREE)], 6, 3),
                          {}),
    "loop_gpt_tied_across_ranks": (workers.case_gpt, (chunk_workers.GPT_LOOP, 6, 3), {}),
    # one group: both chunks' last backwards come after the buckets arm, and the tied weight waits for both
    "loop_gpt_one_group_tied": (workers.case_gpt, ([((0, 4), [0, 1, 2, 3]), ((4, 7), [0, 1, 2, 3])], 8, 4), {}),
    "loop_clip_tied_across_ranks": (workers.case_clip, (chunk_workers.GPT_LOOP, 6, 3), {})}, LOOP))
SHAPES = list(CASES)
CASES.update({
    "eval_v": (chunk_workers.case_eval, ([((0, 1), ONE), ((1, 2), THREE), ((2, 3), THREE), ((3, 4), ONE)], 6, 3, V,
                                         9), {}),
    "eval_loop": (chunk_workers.case_eval, ([((0, 1), PAIR), ((1, 2), OTHER), ((2, 3), PAIR), ((3, 4), OTHER)], 4, 2,
                                            LOOP, 6), {}),
    "holdings_v": (chunk_workers.case_holdings, (chunk_workers.GPT_V, V), {}),
})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cases = dict(CASES, checkpoints=(chunk_workers.case_checkpoints, (str(tmp_path_factory.mktemp("ckpt")),), {}))
    return run_ranks(workers.run_cases, 4, cases, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_chunks_equal_single_process(results, shape):
    steps = assert_transparent(results, shape)
    if shape in CHAINS:  # every bucket launched during the last ops, once its gradients were final on every chunk
        for rank, per_step in enumerate(steps):
            for res in per_step:
                buckets, early = res["buckets"]
                assert early == buckets, (shape, rank, res["buckets"])
    if "clip" in shape:
        for per_step in steps:
            assert all(r["norm"] <= TOL for r in per_step)


@pytest.mark.slow
def test_evaluation_through_chunks(results):
    for case, rows in (("eval_v", 9), ("eval_loop", 6)):
        got = [r[case] for r in results]
        assert all(g["loss"] <= TOL and g["outputs"] <= TOL for g in got), got
        assert sum(g["rows"] for g in got) == rows  # the last stage's replicas return every row once
    v = [r["eval_v"] for r in results]
    assert [g["stages"] for g in v] == [[0, 3], [1, 2], [1, 2], [1, 2]]
    assert [g["data_stages"] for g in v] == [(0, 3), (1, 2), (1, 2), (1, 2)]
    assert [g["targets"] for g in v] == [True, False, False, False]  # rank 0 holds the last stage too


@pytest.mark.slow
def test_a_rank_of_chunks_holds_each_of_their_parameters_once(results):
    held = [r["holdings_v"] for r in results]
    tied = "wte.weight"  # wte (stage 0) and lm_head (stage 3), both on ranks 0 and 1
    for h in held[:2]:
        assert h["stages"] == [0, 3] and h["names"].count(tied) == 1 and h["params"] == len(h["names"])
        assert "lm_head.weight" in h["keys"] and "wte.weight" in h["keys"]  # the state dict's keys, both names
        assert "stages=[0, 3]/4" in h["repr"]
    assert all(tied not in h["names"] for h in held[2:])
    names = set().union(*(h["names"] for h in held))
    assert names == {n for n, _ in chunk_workers._gpt().named_parameters()}


@pytest.mark.slow
def test_checkpoints_across_plans_with_and_without_chunks_are_bit_identical(results):
    got = [torch.load(__import__("io").BytesIO(r["checkpoints"]), weights_only=False) for r in results]
    ref = chunk_workers.full_reference()
    for plan in ("v", "straight"):
        saved = {}
        for g in got:
            saved.update(g[f"{plan}_saved"])
        assert set(saved) == set(ref["params"])
        for n, (p, _) in saved.items():  # the two plans trained alike
            assert float((p - ref["params"][n]).abs().max()) <= 1e-9, (plan, n)
        for rank, g in enumerate(got):
            for load in [k for k in g if k.startswith(f"{plan}->") and not k.endswith("_loss")]:
                for n, (p, state) in g[load].items():
                    assert torch.equal(p, saved[n][0]), (load, rank, n)
                    assert state.keys() == saved[n][1].keys()
                    assert all(torch.equal(v, saved[n][1][k]) for k, v in state.items()), (load, rank, n)
                assert abs(g[f"{load}_loss"][0] - ref["losses"][2]) <= 1e-9, (load, rank)
