"""The split backward (B then W) gives the gradients of one backward, runs no weight work in B, and accumulates
each parameter once per W."""

from __future__ import annotations

import torch
from torch import nn

from dapple.core.backward import backward_input, backward_weight


class Tied(nn.Module):
    """A Linear used twice (tied), a parameter-only output, and an input passed through unchanged."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.pos = nn.Parameter(torch.randn(4))

    def forward(self, x, z):
        h = torch.tanh(self.a(x))
        h = self.b(h) + self.a(h) * z.sum()
        return h, self.pos * 2.0, z


def _reference(model, x, z, grads):
    x, z = x.detach().requires_grad_(), z.detach().requires_grad_()
    outs = model(x, z)
    torch.autograd.backward([o for o in outs], list(grads))
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return x.grad, z.grad, got


def test_split_equals_one_backward_and_defers_weight_gradients():
    torch.manual_seed(0)
    model = Tied().double()
    x, z = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    grads = [torch.randn(3, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64),
             torch.randn(3, 4, dtype=torch.float64)]
    gx, gz, ref = _reference(model, x, z, grads)
    counts = {n: 0 for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: counts.__setitem__(n, counts[n] + 1))
    xs = [x.detach().requires_grad_(), z.detach().requires_grad_()]
    outs = model(*xs)
    got, work = backward_input(list(outs), grads, xs, list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # B: input gradients only
    torch.testing.assert_close(got[0], gx, rtol=1e-12, atol=0)
    torch.testing.assert_close(got[1], gz, rtol=1e-12, atol=0)
    backward_weight(work)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-12, atol=1e-15)
    assert set(counts.values()) == {1}, counts  # each parameter accumulated once (the AllReduce hooks count on it)


def test_no_inputs_needing_gradients_leaves_everything_to_w():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    loss = model(x).square().mean()
    got, work = backward_input([loss], [None], [], list(model.parameters()))
    assert got == [] and all(p.grad is None for p in model.parameters())
    backward_weight(work)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    ref.load_state_dict(model.state_dict())
    ref(x).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)


class Spy(torch.autograd.Function):
    """Identity that counts its backward runs: a stand-in for the input-gradient path of a layer."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        Spy.calls += 1
        return g


def test_w_does_not_run_the_input_gradient_path_again():
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4).double() for _ in range(3)]
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    h = x
    for lin in layers:
        h = Spy.apply(torch.tanh(lin(h)))
    Spy.calls = 0
    params = [p for lin in layers for p in lin.parameters()]
    backward_input([h], [torch.ones_like(h)], [x], params)[1]
    assert Spy.calls == 3
    _, work = backward_input([h], [torch.ones_like(h)], [x], params)
    Spy.calls = 0
    backward_weight(work)
    assert Spy.calls == 0 and all(p.grad is not None for p in params)
