"""Per-layer modules and the recording run: chained, the layers compute exactly what the model computes."""

from __future__ import annotations

import torch
from torch import nn

from dapple.models import GPT, ResNet
from dapple.profiler import trace_layers
from dapple.profiler.record import fresh, layer_module, record_inputs


def _replay(model, inputs):
    """Run every layer module on its own from the recorded values; check each output against the recording."""
    lg = trace_layers(model)
    layers = [layer_module(lg, k) for k in range(lg.num_layers)]
    values = record_inputs(lg, layers, inputs)
    for lm in layers[:-1]:
        out = lm.gm(*[fresh(values[a]) for a in lm.inputs])
        for node, value in zip(lm.outputs, out):  # every output but the model's is a later layer's input
            assert node in values, node
            torch.testing.assert_close(value, values[node], rtol=0, atol=0)
    last = layers[-1]
    return lg, values, last.gm(*[fresh(values[a]) for a in last.inputs])


def test_gpt_layers_replayed_alone_give_the_model_output():
    m = GPT(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8).double()
    x = torch.randint(0, 32, (3, 8))
    lg, values, out = _replay(m, (x,))
    torch.testing.assert_close(out, m(x), rtol=0, atol=0)
    block_input = next(a for a in layer_module(lg, 3).inputs)
    assert values[block_input].requires_grad  # recorded as in training: activations require grad


def test_resnet_layers_replayed_alone_give_the_model_output():
    m = ResNet(widths=(4, 8), depth=1, norm="group").double()  # group norm: no running statistics to drift
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    _, values, out = _replay(m, (x,))
    torch.testing.assert_close(out, m(x))


class Multi(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        h = self.a(x)
        return self.b(h), h  # an earlier layer's value is part of the model's output


def test_last_layer_returns_the_model_output_structure():
    m = Multi().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    _, _, out = _replay(m, (x,))
    ref = m(x)
    assert isinstance(out, tuple) and len(out) == 2
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(out[1], ref[1])


def test_fresh_copies_are_private_and_non_leaf():
    t = torch.randn(2, 3).requires_grad_()
    c = fresh(t.detach().requires_grad_())
    assert c.requires_grad and c.grad_fn is not None  # in-place ops on it are allowed
    c.add_(1)
    assert not torch.equal(c, t)
