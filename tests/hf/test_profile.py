"""dapple.profile and trace_layers on transformers models as they come: ModelOutput to the loss, blocks at any
depth (inside a user's wrapper too), concrete_args into **kwargs, a plan naming the layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dapple
from dapple.profiler import trace_layers
from tests.conftest import needs_export
from tests.hf.models import VOCAB, bert, causal_lm_loss, classifier_loss, gpt2

pytest.importorskip("transformers")
pytestmark = needs_export

GPT2 = ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0", "transformer.h.1",
        "transformer.ln_f", "lm_head"]


def test_profile_gives_the_loss_the_model_output_and_a_plan_names_the_blocks():
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, 8))
    prof = dapple.profile(gpt2(), ids, causal_lm_loss, [2, 4], targets=ids, repeats=1, warmup=0, device="cpu")
    assert prof.layer_names == GPT2 and prof.meta["tracer"] == "export"
    assert prof.meta["layering"] == {"rule": "blocks", "blocks": ["transformer.h"]}
    plan = dapple.plan(prof, dapple.Cluster.local(4, measure=False), 8)
    assert plan.layer_names == GPT2


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
    assert prof.layer_names == ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "bert.pooler",
                                "dropout", "classifier"]
