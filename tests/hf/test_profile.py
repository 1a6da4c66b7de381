"""dapple.profile and trace_layers on transformers models as they come: ModelOutput to the loss, blocks at any
depth (inside a user's wrapper too), concrete_args into **kwargs, a plan naming the layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dapple
from dapple.profiler import trace_layers
from tests.conftest import needs_export
from tests.hf.models import BERT, CASES, GPT2, VOCAB, bert, causal_lm_loss, classifier_loss, gpt2

pytest.importorskip("transformers")
pytestmark = needs_export

def test_profile_gives_the_loss_the_model_output_and_a_plan_names_the_blocks():
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, 8))
    prof = dapple.profile(gpt2(), ids, causal_lm_loss, [2, 4], targets=ids, repeats=1, warmup=0, device="cpu")
    assert prof.layer_names == list(GPT2) and prof.meta["tracer"] == "export"
    assert prof.meta["layering"] == {"rule": "blocks", "blocks": ["transformer.h"]}
    plan = dapple.plan(prof, dapple.Cluster.local(4, measure=False), 8)
    assert plan.layer_names == list(GPT2)


class Wrapper(nn.Module):
    """A user's module around a transformers model: returns the logits only."""

    def __init__(self):
        super().__init__()
        self.lm = gpt2()

    def forward(self, ids):
        return self.lm(ids).logits


def test_blocks_inside_a_users_wrapper():
    ids = torch.randint(0, VOCAB, (2, 8))
    assert trace_layers(Wrapper(), example_inputs=ids).names == [f"lm.{n}" for n in GPT2]


def test_concrete_args_reach_a_forward_that_takes_them_as_kwargs():
    """BertForSequenceClassification takes return_dict through **kwargs: a tuple comes out."""
    torch.manual_seed(0)
    ids, labels = torch.randint(0, VOCAB, (4, 8)), torch.randint(0, 3, (4,))
    prof = dapple.profile(bert(), ids, lambda out, y: classifier_loss(type("O", (), {"logits": out[0]}), y), [4],
                          targets=labels, repeats=1, warmup=0, device="cpu", concrete_args={"return_dict": False})
    assert prof.layer_names == list(BERT)


@pytest.mark.parametrize("name", ["llama", "cnn", "leaf"])
def test_layers_by_the_default_rule(name):
    """(GPT-2's and BERT's: above.) Llama's rotary embedding computes a table from positions alone, which each
    block that uses it computes again: it is no layer. tests/hf/test_hf.py pipelines each model by these layers."""
    case = CASES[name]
    example = case.batch(2, 8, torch.Generator().manual_seed(0))[0]
    lg = trace_layers(case.make(), example_inputs=example, tracer=case.tracer, leaf_modules=case.leaf_modules)
    assert lg.names == list(case.layers)
