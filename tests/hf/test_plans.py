"""Profile -> dapple.plan -> YAML -> dapple.pipeline(model, plan, loss_fn) with nothing repeated, inputs by name:
T5 (its relative position bias crosses a cut whole, to a replicated stage too) and BLOOM with a padding mask (its
attention_mask comes after the cache: by name only), on 4 ranks, float64, against single-process training."""

from __future__ import annotations

import pytest
import torch

import dapple
from dapple.planner import Plan, Stage
from tests.conftest import needs_export
from tests.hf import plan_workers as w
from tests.hf.models import bloom, by_name, padded_lm_loss, seq2seq_loss, t5
from tests.runtime._spawn import run_ranks

pytest.importorskip("transformers")
pytestmark = [needs_export, pytest.mark.slow]

TOL = 1e-9
SLOW_ALLREDUCE = dict(intra_allreduce_bandwidth=1e5)  # a cluster on which dapple.plan pipelines the tiny models


def _profile(make, loss_fn, decoder):
    torch.manual_seed(0)
    xs, ys = by_name(4, 8, torch.Generator().manual_seed(0), decoder)
    return dapple.profile(make(), xs, loss_fn, (4,), targets=ys, repeats=1, warmup=0, device="cpu")


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_plans")
    cluster = dapple.Cluster(1, 4, 1e9, 1e9, 0.0, 0.0, 1e12, **SLOW_ALLREDUCE)
    plans, cases = {}, {}
    for name, make, loss_fn, decoder in (("t5", t5, seq2seq_loss, True), ("bloom", bloom, padded_lm_loss, False)):
        prof = _profile(make, loss_fn, decoder)
        plans[name] = dapple.plan(prof, cluster, w.GLOBAL, verify=0)
        plans[name].save(tmp / f"{name}.yaml")
        cases[name] = (str(tmp / f"{name}.yaml"), make, loss_fn, decoder)
    # by hand, from the plan's tracing: the bias made in encoder.block.0 (layer 2) goes whole to two replicas
    t5_hand = Plan(w.GLOBAL, 4, [Stage((0, 3), [0]), Stage((3, 5), [1, 2]), Stage((5, 10), [3])],
                   layer_names=plans["t5"].layer_names, tracing=plans["t5"].tracing)
    t5_hand.save(tmp / "t5_hand.yaml")
    cases["t5_hand"] = (str(tmp / "t5_hand.yaml"), t5, seq2seq_loss, True)
    return plans, run_ranks(w.run_all, 4, cases, timeout=400)


@pytest.mark.parametrize("case", ["t5", "t5_hand", "bloom"])
def test_the_plan_runs_exactly_with_nothing_repeated(planned, case):
    plans, results = planned
    for rank, r in enumerate(res[case] for res in results):
        for step in r["steps"]:
            assert step["loss"] <= TOL and all(e <= TOL for e in step["grads"].values()), (case, rank, step)
        assert r["eval"] <= TOL, (case, rank, r["eval"])
    if case != "t5_hand":
        p = plans[case]
        assert p.num_stages > 1 and p.tracing.tracer == "export" and p.tracing.by_name
        assert [i.name for i in p.tracing.inputs] == (["input_ids", "attention_mask", "decoder_input_ids"]
                                                      if case == "t5" else ["input_ids", "attention_mask"])
    else:
        assert [r["t5_hand"]["whole"] for r in results][0] == 1  # stage 0 sends the bias whole


def test_a_transformers_model_without_example_inputs_says_to_give_them_first():
    from dapple.profiler import TraceError, trace_layers
    with pytest.raises(TraceError, match=r"^torch.fx could not trace BloomForCausalLM; torch.export may: pass "
                                         r"example_inputs=.* with tracer='auto' or 'export'"):
        trace_layers(bloom())
