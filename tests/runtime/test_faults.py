"""A rank that vanishes or stalls mid-training makes the others raise within the timeout, naming stage,
peer and micro-batch, or for a collective the ranks that did not come and where they are; never a hang."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

import dapple
from tests.runtime import workers
from tests.runtime._spawn import STALL_LIMIT, reported, run_ranks, stall_until_reported
from tests.runtime.workers import Chain, _chain_data, _plan


def _both_told(key: str, msg: str | None) -> str | None:
    """Report, then wait until both ranks have (rank 0 hosts the store the other reads its error's names from)."""
    reported(key)
    stall_until_reported(key, 2)
    return msg


def skipped_clip(timeout: float) -> str | None:
    """Two stages: both clip after step 1, only rank 0 after step 2; what each saw. Built, and step 1 run and
    clipped, with a long timeout (building waits for the slowest rank's tracing, a first step for lazy
    initialisations: seconds on a busy machine); then every wait is bounded by ``timeout``."""
    torch.manual_seed(0)
    model = Chain().double()
    pipe = dapple.pipeline(model, _plan(model, [((0, 2), [0]), ((2, 5), [1])], 8, 2), F.cross_entropy, timeout=30)
    x, y = _chain_data(8)
    pipe.train_step(x, y)
    pipe.clip_grad_norm_(1.0)
    pipe.timeout = pipe._runner.timeout = pipe._batch_check.timeout = pipe._p2p.timeout = timeout
    try:
        pipe.train_step(x, y)
        if int(os.environ["RANK"]) == 0:
            pipe.clip_grad_norm_(1.0)
        pipe.train_step(x, y)
        msg = "no error"
    except dapple.runtime.PipelineError as e:
        msg = str(e)
    return _both_told("clip", msg)


@pytest.fixture(scope="module")
def outcomes():
    """Both scenarios at once (two independent worlds), as they mostly wait."""
    with ThreadPoolExecutor(3) as pool:
        # rank 2 (last stage) exits in its 6th forward: step 2, micro-batch 1 (4 micro-batches per step)
        vanished = pool.submit(run_ranks, workers.run_failing_peer, 3, 2, 6, 30.0, timeout=150)
        # rank 1 stalls in its 7th forward (step 2, micro-batch 2) until rank 0 has raised (1.5 s timeout), then exits
        stalled = pool.submit(run_ranks, workers.run_failing_peer, 2, 1, 7, 1.5, True, timeout=150)
        # rank 1 skips clip_grad_norm_ after step 2: both wait in different collectives until the timeout (2 s)
        clip = pool.submit(run_ranks, skipped_clip, 2, 2.0, timeout=150)
        return {"vanished": vanished.result(), "stalled": stalled.result(), "clip": clip.result()}


def _seconds(msg: str) -> float:
    return float(re.match(r"after ([\d.]+)s", msg).group(1))


@pytest.mark.slow
def test_vanished_rank_makes_the_others_raise(outcomes):
    out = outcomes["vanished"]
    assert out[2] is None  # it vanished without a word
    for rank in (0, 1):
        msg = out[rank]
        assert msg.startswith("after") and _seconds(msg) < 30, msg
        # rank 2 died in its forward of micro-batch 1, so the gradients of micro-batch 1 never come back down
        # (sends are waited on only at the end of a step: the first wait to fail is this receive); nor, on a busy
        # machine, those of micro-batch 0, if its send of them had not left when it died (seen under load)
        assert re.search(rf"rank {rank} \(stage {rank}\), step 2: failed waiting for gradients of micro-batch [01] ",
                         msg), msg
        assert f"from rank {rank + 1} (stage {rank + 1})" in msg, msg


@pytest.mark.slow
def test_stalled_rank_times_out_the_others(outcomes):
    msg = outcomes["stalled"][0]
    # K = 2, 1: rank 0 runs F0 F1 B0 F2 B1 F3 and waits for micro-batch 2's gradients while rank 1 stalls in F2
    assert "rank 0 (stage 0), step 2: timed out waiting for gradients of micro-batch 2 " in msg, msg
    assert "from rank 1 (stage 1)" in msg, msg
    assert 1.2 < _seconds(msg) < STALL_LIMIT, msg  # the timeout, not the stall's end ("Connection closed by peer")


@pytest.mark.slow
def test_a_rank_that_skips_clipping_is_named_with_the_cause(outcomes):
    """Clipping runs on its own group: the ranks wait in different collectives and time out, instead of gloo
    aborting a process on a mismatched one; each collective's timeout names the rank that did not come to it and
    where that rank is (gloo says only "Operation timed out!")."""
    first, second = outcomes["clip"]
    hint = "(every rank must call clip_grad_norm_ after the same steps, or none)"
    assert first.startswith("rank 0 (stage 0), clip_grad_norm_ after step 2: the gradient norm's AllReduce failed "
                            "or timed out (timeout 2s)"), first
    assert first.endswith(f"not every rank came to it: rank 1 (stage 1) is at 'step 3: checking that the ranks' "
                          f"batches agree' {hint}"), first
    assert second.startswith("rank 1 (stage 1), step 3: checking that the ranks' batches agree failed or timed out "
                             "(timeout 2s)"), second
    assert second.endswith("not every rank came to it: rank 0 (stage 0) is at 'clip_grad_norm_ after step 2: the "
                           f"gradient norm's AllReduce' {hint}"), second


@pytest.mark.slow
@pytest.mark.parametrize("long_group_timeout", [False, True], ids=["gloo", "nccl_watchdog"])
def test_a_rank_that_never_calls_pipeline_is_named_within_the_timeout(long_group_timeout):
    # an NCCL group's timeout is its watchdog's, 2 x timeout + 30 s: joining is still bounded by dapple's timeout
    msg = run_ranks(workers.run_absent_rank, 2, 1.5, long_group_timeout, timeout=60)[0]
    assert "rank 0: joining the default process group of 2 ranks (did every rank start?) failed or timed out " \
        "(timeout 1.5s)" in msg, msg
    assert _seconds(msg) < 1.5 + 15, msg  # not 2 x 1.5 + 30 s; slack for building the pipeline on a busy machine
