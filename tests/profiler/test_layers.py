"""Layer grouping: module paths in execution order, valid cuts, copies of input-only nodes, params."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dapple.models import GPT, EmulatedNet, ResNet
from dapple.profiler import TraceError, trace_layers
from dapple.profiler.layers import arity


def _check_monotone(lg):
    for n, k in lg.layer_of.items():
        for u in n.users:
            if u.op != "output":
                assert lg.layer_of[u] >= k, (n.name, u.name)


def test_gpt_layers_are_embedding_blocks_norm_head():
    lg = trace_layers(GPT(n_layer=3))
    assert lg.names == ["wte", "wpe", "drop", "blocks.0", "blocks.1", "blocks.2", "ln_f", "lm_head"]
    _check_monotone(lg)
    # the position arange depends only on the input: it stays inside wpe's layer, nothing but activations cross
    for k in range(lg.num_layers - 1):
        for n in lg.crossing(k):
            assert n.op not in ("get_attr", "placeholder") and "arange" not in n.name


def test_grouped_graph_computes_the_model():
    m = GPT(n_layer=2).double()
    x = torch.randint(0, 512, (3, 10))
    assert torch.equal(trace_layers(m).gm(x), m(x))


def test_tied_parameter_counted_once():
    m = GPT(n_layer=2)
    lg = trace_layers(m)
    params = [p for ps in lg.params_by_layer() for _, p in ps]
    assert len({id(p) for p in params}) == len(params)
    assert sum(p.numel() for p in params) == sum(p.numel() for p in m.parameters())
    names = [[n for n, _ in ps] for ps in lg.params_by_layer()]
    assert "wte.weight" in names[0] and names[-1] == []  # the head's weight is the embedding's


def test_residual_model_and_sequential_expansion():
    lg = trace_layers(ResNet(widths=(8, 16), depth=2))
    assert lg.names == ["stem.0", "stem.1", "stem.2", "layers.0", "layers.1", "layers.2", "layers.3", "pool", "fc"]
    _check_monotone(lg)
    assert all(len(lg.crossing(k)) == 1 for k in range(lg.num_layers - 1))  # skips stay inside blocks


class LongSkip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        h = self.a(x)
        return self.d(self.c(self.b(h)) + h)  # h skips over b and c


def test_long_skip_crosses_every_cut_it_spans():
    lg = trace_layers(LongSkip())
    assert lg.names == ["a", "b", "c", "d"]
    crossing = [{n.name for n in lg.crossing(k)} for k in range(3)]
    assert crossing[0] == {"a"}
    assert crossing[1] == {"a", "b"}  # b's output and the skip
    assert crossing[2] == {"add"}  # the sum joins c, the latest layer it reads


class Reuse(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.mid = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.enc(self.mid(self.enc(x)))  # enc is used again after mid


def test_module_reused_later_keeps_cuts_valid():
    lg = trace_layers(Reuse())
    _check_monotone(lg)
    assert lg.names == ["enc", "mid"]  # the second enc call runs in mid's layer, with a shared parameter


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return self.fc(x)
        return x


def test_untraceable_model_gets_a_useful_error():
    with pytest.raises(TraceError) as e:
        trace_layers(Untraceable())
    msg = str(e.value)
    assert "could not trace Untraceable" in msg and "if x.sum() > 0" in msg
    assert "leaf_modules" in msg and "concrete_args" in msg


def test_leaf_module_makes_untraceable_block_traceable():
    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.out = Untraceable(), nn.Linear(4, 2)

        def forward(self, x):
            return self.out(self.inner(x))

    lg = trace_layers(Wrap(), leaf_modules=[Untraceable])
    assert lg.names == ["inner", "out"]


def test_emulated_layers_trace_as_one_call_each():
    lg = trace_layers(EmulatedNet([0.0, 0.0, 0.0]))
    assert lg.names == ["layers.0", "layers.1", "layers.2", "head"]


class Masked(nn.Module):
    """forward(x, mask=None) with an ``if mask is not None`` branch, as attention models have."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x, mask=None, scale=1.0):
        h = self.a(x)
        if mask is not None:
            h = h * mask
        return self.b(h) * scale


def test_a_none_default_traced_as_a_tensor_must_be_given():
    traced = arity(trace_layers(Masked()).gm)  # fx takes the branch: mask is used as a tensor
    assert (traced.names, traced.need, traced.traced_none) == (["x", "mask", "scale"], 2, ["mask"])
    traced.check(2, "inputs")
    traced.check(3, "inputs")
    with pytest.raises(ValueError, match=r"^inputs: the model takes 2 to 3 inputs \['x', 'mask', 'scale'\], got 1; "
                                         r"\['mask'\] default to None but the model was traced with them as tensors "
                                         r".*trace with concrete_args=\{'mask': None\}$"):
        traced.check(1, "inputs")
    kept = arity(trace_layers(Masked(), concrete_args={"mask": None}).gm)  # only fx's _assert_is_none reads it
    assert (kept.need, kept.traced_none) == (1, [])
    kept.check(1, "inputs")
    with pytest.raises(ValueError, match=r"^inputs: the model takes 1 to 3 inputs \['x', 'mask_1', 'scale'\], "
                                         r"got 4$"):
        kept.check(4, "inputs")
