"""What crosses a cut and what goes into a model, on 4 processes in float64: a bias without batch rows sent whole
(replicated receivers and senders, relayed, zb-h1), a cut no value may cross refused by name, inputs by name with a
padding mask and each rank's own rows, and plans from dapple.plan that carry how their profile traced the model."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import dapple
from tests.hf.models import Checked, CheckedNet
from tests.profiler.test_api import MaskedNet
from tests.runtime import model_io_workers as w
from tests.runtime._spawn import run_ranks

TOL = 1e-9
WHOLE = {  # stages (layers, devices) of BiasNet: embed, blocks.0-2, head; the bias is made in blocks.0
    "to_replicas": [((0, 2), [0]), ((2, 3), [1, 2]), ((3, 5), [3])],  # 1 -> 2 -> 1, relayed by stage 1
    "from_replicas": [((0, 2), [0, 1]), ((2, 4), [2]), ((4, 5), [3])],  # 2 -> 1: one sender serves the receiver
    "replicas_to_replicas": [((0, 2), [0, 1]), ((2, 5), [2, 3])],  # 2 -> 2
}


def _planned(tmp_path, name, model, batch, **profile_args):
    """Profile ``model``, plan it on 4 devices with dapple.plan, save the plan: what the workers load."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.export traced MaskedNet for these fixed sizes")  # its loop's size
        prof = dapple.profile(model(), *batch[0], loss_fn=profile_args.pop("loss_fn"), targets=batch[1], repeats=1,
                              warmup=0, device="cpu", **profile_args)
    slow_allreduce = dapple.Cluster(1, 4, 1e9, 1e9, 0.0, 0.0, 1e12, intra_allreduce_bandwidth=1e5)  # pipelines win
    plan = dapple.plan(prof, slow_allreduce, w.GLOBAL, verify=0)
    plan.save(tmp_path / f"{name}.yaml")
    return str(tmp_path / f"{name}.yaml"), plan


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plans")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2)
    seqs = ((torch.randn(w.GLOBAL, 5, 6, generator=gen, dtype=torch.float64),),
            torch.randint(0, 3, (w.GLOBAL, 5), generator=gen))
    leaf_net = functools.partial(_double, CheckedNet)
    leaf_path, leaf_plan = _planned(tmp, "leaf", leaf_net, seqs, loss_fn=w.seq_loss, tracer="fx",
                                    leaf_modules=[Checked])
    masked = ((torch.randn(w.GLOBAL, 6, 4, generator=gen, dtype=torch.float64),),
              torch.randn(w.GLOBAL, 6, 2, generator=gen, dtype=torch.float64))
    masked_net = functools.partial(_double, functools.partial(MaskedNet, False))
    masked_path, masked_plan = _planned(tmp, "masked", masked_net, masked, loss_fn=w.mse,
                                        concrete_args={"attn_mask": None})
    cases = {**{f"whole_{k}": (w.case_whole, v) for k, v in WHOLE.items()},
             "whole_zb": (w.case_whole, WHOLE["to_replicas"], "zb-h1"),
             "uncut": (w.case_uncut,), "by_name": (w.case_by_name,),
             "planned_leaf": (w.case_planned, leaf_path, leaf_net(), w.seq_loss, seqs),
             "planned_masked": (w.case_planned, masked_path, masked_net(), w.mse, masked)}
    out = run_ranks(w.run_cases, 4, cases, timeout=300)
    return out, {"leaf": leaf_plan, "masked": masked_plan}


def _double(make):
    torch.manual_seed(0)
    return make().double()


def _exact(res):
    return res["loss"] <= TOL and all(e <= TOL for e in res["grads"].values()) and \
        set(res["grads"]) <= set(res["expected"])


@pytest.mark.slow
@pytest.mark.parametrize("case", [*(f"whole_{k}" for k in WHOLE), "whole_zb"])
def test_a_bias_without_batch_rows_goes_whole_and_training_is_exact(results, case):
    for rank, res in enumerate(r[case] for r in results[0]):
        assert all(_exact(s) for s in res["steps"]), (case, rank, res["steps"])
        assert res["eval"] <= TOL, (case, rank, res["eval"])
        assert res["whole"] >= 1, (case, rank)  # the bias did cross a cut whole
    named = set().union(*(s["grads"] for r in results[0] for s in r[case]["steps"]))
    assert "blocks.0.table" in named  # the bias's parameter got its gradient from every stage reading it


@pytest.mark.slow
def test_a_cut_no_value_may_cross_is_refused_naming_the_layers(results):
    for rank, r in enumerate(results[0]):
        assert r["uncut"].startswith("value 'tanh' crosses the cut after stage 0, between layers 'flat' and "
                                     "'unflat', and cannot be sent: its shape is (12, 8) for 2 rows"), \
            (rank, r["uncut"])
        assert "What to do: cut elsewhere" in r["uncut"]


@pytest.mark.slow
def test_inputs_by_name_with_a_padding_mask_and_own_rows(results):
    for rank, res in enumerate(r["by_name"] for r in results[0]):
        assert all(_exact(s) for s in res["steps"]), (rank, res["steps"])
        assert res["unmasked"] > 1e-3, rank  # the mask matters
        assert res["names"][:2] == ["tokens", "pad_mask"], res["names"]
        assert res["refused"].startswith("inputs: ['mask'] are not inputs of the traced model"), res["refused"]


@pytest.mark.slow
@pytest.mark.parametrize("case, tracer", [("leaf", "fx"), ("masked", "export")])
def test_a_plan_carries_how_its_profile_traced_the_model(results, case, tracer):
    """dapple.pipeline(model, plan, loss_fn): the leaf modules (a class) and concrete_args come from the plan."""
    plan = results[1][case]
    assert plan.tracing.tracer == tracer and plan.tracing.inputs and plan.num_stages > 1
    if case == "leaf":
        assert plan.tracing.leaf_modules == ("class:tests.hf.models.Checked",)
    else:
        assert plan.tracing.concrete_args == {"attn_mask": None}
    for rank, r in enumerate(results[0]):
        assert _exact(r[f"planned_{case}"]), (case, rank, r[f"planned_{case}"])
