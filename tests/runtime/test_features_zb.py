"""The training features under the zero-bubble schedule (zb-h1) on 4 processes: bf16/fp16 autocast, recomputation
(a recomputed stage runs its whole backward in B) and the loss checks, with test_features' assertions."""

from __future__ import annotations

import pytest

from tests.runtime import feature_workers as fw
from tests.runtime import workers
from tests.runtime._spawn import run_ranks
from tests.runtime.test_features import (  # collected here again, on this module's results
    test_a_wrong_loss_makes_every_rank_raise_and_the_pipeline_goes_on,
    test_bf16_is_autocast_with_half_the_bytes_on_the_wire,
    test_fp16_skips_an_overflowing_step_on_every_rank,
    test_recomputation_is_exact,
)

__all__ = ["test_a_wrong_loss_makes_every_rank_raise_and_the_pipeline_goes_on",
           "test_bf16_is_autocast_with_half_the_bytes_on_the_wire",
           "test_fp16_skips_an_overflowing_step_on_every_rank", "test_recomputation_is_exact"]


@pytest.fixture(scope="module")
def results():
    cases = {k: v for k, v in fw.CASES.items() if k != "recompute_batchnorm"}
    return run_ranks(fw.run_cases, 4, workers.with_schedule(cases, "zb-h1"), timeout=240)
