"""dapple.runtime.launch (torch's elastic launcher, as torchrun) on 2 processes: straight 2 stages, pure DP."""

from __future__ import annotations

import pytest

from dapple.runtime import launch
from tests.runtime import workers
from tests.runtime.test_engine import TOL


@pytest.mark.slow
def test_two_ranks_under_the_elastic_launcher():
    results = launch(workers.run_cases, 2, workers.CASES_2)
    assert sorted(results) == [0, 1]
    for shape in workers.CASES_2:
        for rank, per_step in results.items():
            for res in per_step[shape]:
                bad = {n: e for n, e in res["grads"].items() if not e <= TOL}  # a NaN is bad too
                assert res["loss"] <= TOL and res["grads"] and not bad, (shape, rank, res)
        names = set().union(*(set(r[shape][0]["grads"]) for r in results.values()))
        assert names == set(results[0][shape][0]["expected"])
    # straight: each rank holds half the layers; pure DP: both hold everything
    assert not set(results[0]["straight_2"][0]["grads"]) & set(results[1]["straight_2"][0]["grads"])
    assert set(results[0]["pure_dp_2"][0]["grads"]) == set(results[1]["pure_dp_2"][0]["grads"])
