"""The DP prices recomputing stages (B + F, D from their inputs) and half-precision activations exactly: it finds
the brute force's optimum under those costs."""

from __future__ import annotations

import functools

import pytest

from dapple.planner.baselines import exhaustive
from dapple.planner.model.cost import CostModel
from dapple.planner.search.dp import INF, DPSearch, SearchConfig, can_occupy

from ..helpers import small_instances


@pytest.mark.parametrize("recompute, mixed_precision", [(True, None), (False, "bf16"), (True, "fp16")])
def test_dp_finds_the_brute_force_optimum_with_recompute_and_mixed_precision(monkeypatch, recompute,
                                                                           mixed_precision):
    priced = functools.partial(CostModel, recompute=recompute, mixed_precision=mixed_precision)
    monkeypatch.setattr(exhaustive, "CostModel", priced)  # the brute force under the same costs
    config = SearchConfig(model="refined", recompute=recompute, mixed_precision=mixed_precision)
    checked = 0
    for prof, c, g, b in small_instances(5, 40, memory=(8e9, 3e9, 1.5e9)):
        best, spans, _ = exhaustive.exhaustive_search(prof, c, g, b, model="refined")
        if not can_occupy(c.num_devices, prof.num_layers, b, None):
            continue
        dp = DPSearch(prof, c, g, b, config, INF)
        dp.run()
        res = dp.result()
        if best == float("inf"):
            assert res is None
            continue
        checked += 1
        assert res is not None and res.latency == pytest.approx(best, rel=1e-9), (c.name, g, b, res, spans)
    assert checked >= 20
