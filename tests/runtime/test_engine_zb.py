"""Transparency of the zero-bubble schedule (zb-h1: input-gradient B, deferred weight-gradient W) on 4 processes
(gloo, float64): loss and every gradient equal single-process training for every plan shape of test_engine."""

from __future__ import annotations

import pytest

from tests.runtime import workers
from tests.runtime._spawn import run_ranks
from tests.runtime.test_engine import SHAPES, assert_transparent

ZB_SHAPES = [s for s in SHAPES if s != "gpipe"]  # "gpipe" names its schedule


@pytest.fixture(scope="module")
def results():
    cases = workers.with_schedule({k: workers.CASES_4[k] for k in ZB_SHAPES}, "zb-h1")
    cases["memory"] = (workers.case_memory, (), {"schedules": ("dapple", "zb-h1")})
    return run_ranks(workers.run_cases, 4, cases, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ZB_SHAPES)
def test_zb_h1_equals_single_process(results, shape):
    assert_transparent(results, shape)


@pytest.mark.slow
def test_zb_h1_gradient_allreduce_starts_in_the_last_w(results):
    for rank, per_step in enumerate(r["pure_dp_4"] for r in results):
        for res in per_step:
            buckets, early = res["buckets"]
            assert buckets > 0 and early == buckets, (rank, res["buckets"])  # all launched by the last W's hooks


@pytest.mark.slow
def test_zb_h1_holds_k0_micro_batches_on_every_stage_whatever_m(results):
    """Saved-for-backward bytes per rank (straight 4 stages, K = 4, 3, 2, 1): a micro-batch's activations stay until
    its W, and every stage defers W up to K_0 = 4 in flight: 4 micro-batches on each rank, at M = 4 and 8."""
    for rank, peaks in enumerate(r["memory"] for r in results):
        per_micro_batch = peaks["dapple/4"] / (4 - rank)  # dapple holds K_i
        for m in (4, 8):
            assert peaks[f"zb-h1/{m}"] == pytest.approx(4 * per_micro_batch, rel=0.02), (rank, m, peaks)
