"""Boundaries no plan may cut: the planners never cut them, evaluate refuses stages that do, the document keeps them."""

from __future__ import annotations

import dataclasses
import random

import pytest

from dapple import Plan, Profile
from dapple import plan as make_plan
from dapple.planner import Stage, evaluate, pipedream_plan
from dapple.planner.cuts import joined
from dapple.planner.model.cost import CostModel

from .helpers import cluster, random_profile


def _uncut(prof: Profile, after: set[int]) -> Profile:
    """``prof`` with no cut allowed after the layers ``after``."""
    layers = [dataclasses.replace(x, cuttable=i not in after) for i, x in enumerate(prof.layers)]
    return Profile(prof.model, prof.device, prof.batch_sizes, layers, meta={"uncuttable": {
        prof.layers[i].name: f"value 'v{i}': its shape is (6, 4) for 2 rows" for i in after}}, call_ms=[0.02, 0.03])


def _ends(p: Plan) -> set[int]:
    return {s.layers[1] - 1 for s in p.stages[:-1]}


def test_joined_layers_cost_what_the_layers_cost_together():
    prof = _uncut(random_profile(random.Random(3), 6), {1, 2})  # layers 1, 2 and 3 are one for the planner
    j = joined(prof)
    assert j.starts == [0, 1, 4, 5, 6] and j.profile.num_layers == 4 and not j.profile.uncuttable
    assert j.profile.layers[1].name == "l1..l3" and j.profile.meta["joined_layers"] == [["l1", "l3"]]
    assert j.profile.layers[1].boundary_bytes == prof.layers[3].boundary_bytes
    assert [x.inputs for x in j.profile.layers] == [[], [0], [1], [2]]
    c = cluster(1, 2)
    for rows in (2, 3, 8):
        whole, parts = CostModel(j.profile, c, rows), CostModel(prof, c, rows)
        for a, b, c2, d in ((0, 2, 0, 4), (1, 3, 1, 5), (2, 4, 4, 6)):
            assert whole.compute(a, b, 1) == pytest.approx(parts.compute(c2, d, 1))
            assert whole.saved_bytes(a, b, 1) == pytest.approx(parts.saved_bytes(c2, d, 1))
            assert whole.params(a, b) == parts.params(c2, d)


def test_plans_never_cut_an_uncuttable_boundary():
    base = random_profile(random.Random(5), 8)
    c = cluster(2, 2, inter=1e10)
    free = make_plan(base, c, 32, verify=0)
    assert _ends(free), "the instance should cut somewhere"
    prof = _uncut(base, _ends(free))  # forbid exactly the cuts it chose
    for p in (make_plan(prof, c, 32, verify=0), make_plan(prof, c, 32, schedule="auto", verify=0),
              pipedream_plan(prof, c, 32)):
        assert not _ends(p) & set(prof.uncuttable), (p.stages, prof.uncuttable)
        assert p.num_layers == prof.num_layers and p.layer_names == prof.layer_names
    p = make_plan(prof, c, 32, verify=0)
    assert p.estimate == evaluate(prof, c, p)  # estimated on the profile's own layers


def test_evaluate_refuses_a_cut_there_naming_the_layers_and_why():
    prof = _uncut(random_profile(random.Random(5), 4), {1})
    with pytest.raises(ValueError, match=r"evaluate: stage 0 ends after layer 1 \('l1'\), before 'l2', but no plan "
                                         r"may cut there: value 'v1': its shape is \(6, 4\)"):
        evaluate(prof, cluster(1, 2), [(0, 2, [0]), (2, 4, [1])], 8, 4)
    evaluate(prof, cluster(1, 2), [Stage((0, 3), [0]), Stage((3, 4), [1])], 8, 4)


def test_the_profile_document_keeps_the_flag(tmp_path):
    prof = _uncut(random_profile(random.Random(5), 4), {2})
    prof.save(tmp_path / "p.yaml")
    again = Profile.load(tmp_path / "p.yaml")
    assert [x.cuttable for x in again.layers] == [True, True, False, True] and again.uncuttable == [2]
    assert "l2|" in str(again) and "no plan cuts after the layer" in str(again)
    doc = prof.to_dict()
    doc["layers"][0]["cuttable"] = "no"
    with pytest.raises(ValueError, match=r"layers\[0\] \(l0\).cuttable: expected true or false, got 'no'"):
        Profile.from_dict(doc)


def test_a_plan_of_a_joined_profile_keeps_what_it_was_planned_for():
    """Mapped back onto the profile's layers, the plan keeps every field: sharded optimizer state (its estimate
    priced so), mixed precision, the schedule."""
    prof = _uncut(random_profile(random.Random(4), 6), {2})
    c = cluster(1, 4, inter=1e9)
    p = make_plan(prof, c, 32, shard_optimizer=True, mixed_precision="bf16", workers=1)
    assert p.shard_optimizer and p.mixed_precision == "bf16" and p.estimate.details["shard_optimizer"]
    assert p.estimate.latency_ms == evaluate(prof, c, p).latency_ms
