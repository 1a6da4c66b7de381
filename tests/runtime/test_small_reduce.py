"""reduce_small: the AllReduce of control values by recursive doubling over P2P (gloo) equals dist.all_reduce, gives
every rank the same bits, works on a subgroup and on any world size, and names the peer that never came."""

from __future__ import annotations

import math

import pytest
import torch

from dapple.runtime.small_reduce import reduce_small

from ._spawn import run_ranks
from .small_reduce_workers import reduce_all, reduce_without


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_sum_and_max_equal_every_rank_and_torch(world):
    got = [{k: torch.tensor(v, dtype=torch.float64) for k, v in g.items()} for g in run_ranks(reduce_all, world, 37)]
    vectors = [g["mine"] for g in got]
    for op in ("sum", "max"):
        first = got[0][op]
        for g in got:
            assert torch.equal(g[op], first)  # the same bits on every rank
        assert torch.allclose(first, got[0][f"torch {op}"], rtol=1e-13, atol=0)
    exact = torch.tensor([math.fsum(float(v[i]) for v in vectors) for i in range(37)], dtype=torch.float64)
    assert torch.allclose(got[0]["sum"], exact, rtol=1e-13, atol=0)
    assert torch.equal(got[0]["max"], torch.stack(vectors).amax(0))
    rest = got[1:]
    for g in rest:
        assert torch.equal(g["group sum"], rest[0]["group sum"])
    group_exact = torch.stack(vectors[1:]).sum(0)
    assert torch.allclose(rest[0]["group sum"], group_exact, rtol=1e-13, atol=0)


def test_a_rank_that_never_comes_is_named_by_its_partner():
    errors = run_ranks(reduce_without, 3, 2, timeout=120)
    assert errors[2] is None
    # rank 0 folds in rank 2 (3 ranks: 2 -> 0, then 0 <-> 1); rank 1 waits on rank 0, which waits on rank 2
    assert errors[0].startswith("PipelineError: rank 0, step 7: loss AllReduce failed or timed out (timeout 2s): the "
                                "exchange with rank 2: "), errors[0]
    assert "rank 2" in errors[0] and "no collective of dapple yet" in errors[0], errors[0]
    assert errors[1].startswith("PipelineError: rank 1, step 7: loss AllReduce failed or timed out (timeout 2s): the "
                                "exchange with rank 0: "), errors[1]


def test_an_unknown_op_is_refused():
    with pytest.raises(ValueError, match="expected op 'sum' or 'max', got 'mean'"):
        reduce_small(torch.ones(1), "mean", 1.0, "rank 0", "here", [0])
