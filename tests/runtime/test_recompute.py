"""Recomputation modes in one process: which stages recompute and how; a "layers" module recomputes each layer once
in the backward and trains as the plain module; selective recomputation keeps matmuls and reruns the rest."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dapple.models import GPT
from dapple.profiler import trace_layers
from dapple.runtime.recompute import layered_module, recomputing, run_recomputed
from dapple.runtime.stages import split_stages


def _plan(n: int, modes) -> SimpleNamespace:
    return SimpleNamespace(num_stages=n, stages=[SimpleNamespace(recompute=m) for m in modes])


def test_recomputing_takes_one_mode_or_one_per_stage():
    plan = _plan(3, [False, "layers", True])
    assert recomputing(plan, None) == [False, "layers", True]
    assert recomputing(plan, "selective") == ["selective"] * 3
    assert recomputing(plan, [True, False, "selective"]) == [True, False, "selective"]
    for bad in ("all", 1, [True, False], [True, "some", False]):
        with pytest.raises(ValueError, match=r"recompute: expected None \(the plan's\), one of \(False, True, "
                                             r"'layers', 'selective'\)"):
            recomputing(plan, bad)


class _Counting:
    """Counts the calls of every leaf module of ``model`` (forward hooks)."""

    def __init__(self, model: nn.Module):
        self.calls: dict[str, int] = {}
        self.order: list[str] = []
        for name, m in model.named_modules():
            if not list(m.children()):
                m.register_forward_hook(lambda mod, a, out, name=name: self._hit(name))

    def _hit(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.order.append(name)


def _gpt_stage():
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16).double()
    lg = trace_layers(model)
    graphs = split_stages(lg, [(0, 5), (5, 7)])
    return model, lg, graphs[0].module


def test_a_layers_module_trains_as_the_stage_and_recomputes_each_layer_once():
    model, lg, stage = _gpt_stage()
    layered = layered_module(stage, {n.name: k for n, k in lg.layer_of.items()})
    idx = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    plain_out = stage(idx)[0]
    plain_out.pow(2).sum().backward()
    want = {n: p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad()
    counts = _Counting(stage)
    out = layered(idx)[0]
    forward_calls = dict(counts.calls)
    assert torch.equal(out, plain_out)
    out.pow(2).sum().backward()
    for n, p in stage.named_parameters():  # the same parameter objects, the same gradients
        assert torch.allclose(p.grad, want[n], rtol=0, atol=1e-13), n
    assert forward_calls and all(v == 1 for v in forward_calls.values()), forward_calls
    again = {k: v - forward_calls[k] for k, v in counts.calls.items()}
    # recomputed in the backward, each at most once (a checkpoint stops once what the backward needs is back)
    assert set(again.values()) <= {0, 1}, again
    assert again["blocks.0.ln_1"] == again["blocks.1.ln_1"] == again["blocks.1.mlp.1"] == 1, again
    reruns = counts.order[sum(forward_calls.values()):]
    assert reruns[0].startswith("blocks.1."), reruns  # layer by layer, in backward order (a whole stage: block 0 first)
    assert sum(1 for n in layered.graph.nodes if n.op == "call_function") == 5  # one checkpoint per layer


class _InPlace(nn.Module):
    """Layer 1 changes its input in place: the layer's recomputation must see the input as the forward did."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h.mul_(2).tanh())


def test_a_layers_module_copies_an_input_its_layer_changes_in_place():
    torch.manual_seed(0)
    model = _InPlace().double()
    lg = trace_layers(model, layers=["a", "b"])
    stage = split_stages(lg, [(0, 2)])[0].module
    layered = layered_module(stage, {n.name: k for n, k in lg.layer_of.items()})
    x = torch.randn(3, 4, dtype=torch.float64)
    stage(x)[0].sum().backward()
    want = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad()
    layered(x)[0].sum().backward()
    assert all(torch.allclose(p.grad, w, rtol=0, atol=1e-14) for p, w in zip(stage.parameters(), want))


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode, reruns_matmul", [(True, True), ("selective", False)])
def test_selective_recomputation_reruns_all_but_the_matmuls(mode, reruns_matmul):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 2)).double()
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    net(x).sum().backward()
    want = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    out = run_recomputed(net, (x,), mode)
    with _Ops() as ops:
        out.sum().backward()
    assert ("aten.gelu.default" in ops.seen)  # the elementwise op runs again either way
    assert ("aten.addmm.default" in ops.seen) == reruns_matmul, ops.seen  # the forward's matmul: kept or rerun
    assert all(torch.allclose(p.grad, w, rtol=0, atol=1e-14) for p, w in zip(net.parameters(), want))
