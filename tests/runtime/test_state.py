"""A pipeline's state under the model's keys, its train/eval modes and eval_step, on a world of one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dapple
from dapple.models import GPT, lm_loss, random_tokens
from dapple.planner import Plan, Stage
from dapple.profiler import trace_layers
from tests.conftest import needs_export


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    """dapple.pipeline initialises a one-process world itself when not launched by torchrun."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


class Positions(nn.Module):
    """Token and position embeddings, the positions in a non-persistent buffer (as transformers keeps
    ``position_ids``), dropout, and a head: ids (B, T) -> (B, 3)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("position_ids", torch.arange(16), persistent=False)
        self.tok, self.pos = nn.Embedding(10, 4), nn.Embedding(16, 4)
        self.drop, self.head = nn.Dropout(0.5), nn.Linear(4, 3)

    def forward(self, ids):
        h = self.tok(ids) + self.pos(self.position_ids.narrow(0, 0, ids.size(1)))
        return self.head(self.drop(h)).mean(1)


def _one_stage(model, gbs=8, mbs=4, tracer="auto", **kw):
    names = trace_layers(model, tracer=tracer, **kw).names
    plan = Plan(gbs, mbs, [Stage((0, len(names)), [0])], layer_names=names)
    return dapple.pipeline(model, plan, F.cross_entropy, tracer=tracer, **kw)


def _batch(rows, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    return torch.randint(0, 10, (rows, 6), generator=g), torch.randint(0, 3, (rows,), generator=g)


@needs_export
def test_state_dict_is_the_models_without_non_persistent_buffers_and_loads_strictly(tmp_path):
    model = Positions().double()
    ids, _ = _batch(8)
    pipe = _one_stage(model, tracer="export", example_inputs=ids)
    assert "position_ids" in dict(pipe.module.named_buffers())  # the traced graph holds it as an attribute
    sd = pipe.state_dict()
    assert list(sd) == list(model.state_dict())  # but it is not the model's state
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    dapple.save_checkpoint(tmp_path / "ckpt", pipe)
    full = dapple.load_full_state_dict(tmp_path / "ckpt")
    assert list(full) == list(model.state_dict())
    fresh = Positions().double()
    fresh.load_state_dict(full, strict=True)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_load_state_dict_copies_by_key_and_names_what_does_not_fit():
    torch.manual_seed(0)
    model = Positions().double()
    pipe = _one_stage(model)
    other = Positions().double()
    assert pipe.load_state_dict(other.state_dict()) == ([], [])
    assert all(torch.equal(p, q) for p, q in zip(pipe.parameters(), other.parameters()))
    partial = {k: v for k, v in other.state_dict().items() if k != "head.bias"}
    with pytest.raises(ValueError, match=r"rank 0 \(stage 0\): load_state_dict\(strict=True\): missing keys "
                                         r"\['head.bias'\], keys the model does not have \['extra'\]"):
        pipe.load_state_dict({**partial, "extra": torch.zeros(1)})
    assert pipe.load_state_dict({**partial, "extra": torch.zeros(1)}, strict=False) == (["head.bias"], ["extra"])
    with pytest.raises(ValueError, match=r"shapes differ: head.weight: given \(2, 2\), model \(3, 4\)"):
        pipe.load_state_dict({**other.state_dict(), "head.weight": torch.zeros(2, 2)})


@pytest.mark.parametrize("tracer", ["fx", pytest.param("export", marks=needs_export)])
def test_eval_mode_turns_traced_dropout_off_and_train_mode_back_on(tracer):
    """torch.export bakes the training flag into the graph's dropout; fx keeps nn.Dropout a module call."""
    torch.manual_seed(0)
    model = Positions().double()
    ids, y = _batch(12)
    ref = copy.deepcopy(model).eval()
    pipe = _one_stage(model, tracer=tracer, example_inputs=ids[:8])
    assert pipe.training
    with torch.no_grad():
        want = float(F.cross_entropy(ref(ids), y))
    assert pipe.eval() is pipe and not pipe.training
    assert pipe.eval_step(ids, y) == pytest.approx(want, rel=1e-12)  # 3 micro-batches: not the plan's batch
    assert pipe.step == 0 and all(p.grad is None for p in pipe.parameters())
    pipe.train()
    assert pipe.eval_step(ids, y) != pytest.approx(want, rel=1e-6)  # dropout 0.5 on again
    pipe.eval()
    with torch.no_grad():
        want = float(F.cross_entropy(ref(ids[:8]), y[:8]))
    assert pipe.train_step(ids[:8], y[:8]) == pytest.approx(want, rel=1e-12)  # training, with dropout off


def test_functional_attention_dropout_is_off_in_eval_mode():
    """dapple's GPT passes dropout_p=self.dropout if self.training else 0 to scaled_dot_product_attention: fx
    bakes in the training value, which eval mode turns off."""
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=8, dropout=0.5).double()
    names = trace_layers(model).names
    pipe = dapple.pipeline(model, Plan(4, 2, [Stage((0, len(names)), [0])], layer_names=names), lm_loss)
    x, y = random_tokens(4, 8, 32)
    model.eval()
    with torch.no_grad():
        want = float(lm_loss(model(x), y))
    assert pipe.eval().eval_step(x, y) == pytest.approx(want, rel=1e-12)


def test_eval_step_outputs_and_bad_batches():
    torch.manual_seed(0)
    model = Positions().double().eval()
    pipe = _one_stage(model)
    assert not pipe.training  # the model's mode
    ids, y = _batch(8)
    loss, slices = pipe.eval_step(ids, y, outputs=True)
    assert [rows for rows, _ in slices] == [range(0, 4), range(4, 8)]
    with torch.no_grad():
        assert torch.equal(torch.cat([out for _, out in slices]), model(ids))
    with pytest.raises(ValueError, match=r"inputs\[0\] has shape \(6, 6\); expected a batch of a multiple of "
                                         r"plan.micro_batch_size \(4\) rows"):
        pipe.eval_step(*_batch(6))
    with pytest.raises(ValueError, match=r"targets\[0\] has shape \(4,\); expected a batch of a multiple"):
        pipe.eval_step(ids, y[:4])


def test_a_plan_from_a_profile_with_given_layers_gets_those_layers_without_being_told():
    torch.manual_seed(0)
    model = Positions().double()
    ids, y = _batch(8)
    prof = dapple.profile(model, ids, F.cross_entropy, [4], targets=y, repeats=1, warmup=0, device="cpu",
                          layers=["tok", "head"])
    assert prof.layer_names == ["tok", "head"] and prof.meta["layering"]["rule"] == "given"
    plan = dapple.plan(prof, dapple.Cluster.local(1, measure=False), 8)
    model.eval()  # (dropout off: the same loss)
    pipe = dapple.pipeline(model, plan, F.cross_entropy)  # the plan's layer names are module paths: its layers
    ref = copy.deepcopy(model)
    assert pipe.train_step(ids, y) == pytest.approx(float(F.cross_entropy(ref(ids), y).detach()), rel=1e-12)
    with pytest.raises(ValueError, match=r"plan covers 2 layers but the model has 4"):
        dapple.pipeline(model, plan, F.cross_entropy, layers=["tok", "pos", "drop", "head"])
