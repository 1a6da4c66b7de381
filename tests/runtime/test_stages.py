"""Stage split: original parameter names, the stages compose to the model, relayed long skips, tied params."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from dapple.models import GPT
from dapple.profiler import trace_layers
from dapple.runtime.groups import canonical_names, tied_owners
from dapple.runtime.stages import StageGraph, resolve_output, split_stages
from tests.runtime.workers import Skip


class Scaled(nn.Module):
    """Uses a parameter directly (an fx get_attr node) in a later layer: split_module makes it a placeholder."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x):
        return self.b(self.a(x)) * self.scale


def _run_stages(stages: list[StageGraph], inputs: dict[str, torch.Tensor]):
    """Run the stages one after the other as the engine does: pass exactly ``send`` to the next stage."""
    carried: dict[str, torch.Tensor] = {}
    for st in stages:
        assert set(st.recv) == set(carried), (st.index, st.recv, list(carried))
        env = {**inputs, **carried}
        env.update(zip(st.outs, st.module(*[env[a] for a in st.args])))
        if st.output is not None:
            return resolve_output(st.output, env)
        carried = {n: env[n] for n in st.send}
    raise AssertionError("no stage produced the output")


def test_gpt_stages_keep_original_names_and_compose():
    model = GPT(n_layer=3, n_embd=16, vocab_size=40, block_size=12).double()
    lg = trace_layers(model)
    stages = split_stages(lg, [(0, 4), (4, 6), (6, 8)])
    names = [{n for n, _ in st.module.named_parameters(remove_duplicate=False)} for st in stages]
    assert "blocks.0.attn.qkv.weight" in names[0] and "wte.weight" in names[0]
    assert names[1] == {n for n, _ in model.named_parameters() if n.startswith(("blocks.1.", "blocks.2."))}
    assert names[2] == {"ln_f.weight", "ln_f.bias", "lm_head.weight"}
    # the tied head is the very same tensor as the embedding, and is found as tied between stages 0 and 2
    assert stages[2].module.get_parameter("lm_head.weight") is model.wte.weight
    assert tied_owners(stages, canonical_names(model)) == {(0, 2): ["wte.weight"]}
    x = torch.randint(0, 40, (3, 7))
    assert torch.equal(_run_stages(stages, {"idx": x}), model(x))
    assert stages[0].inputs == ["idx"] and stages[1].inputs == []


def test_every_split_of_gpt_composes_even_when_a_later_stage_starts_earlier_in_the_graph():
    """GPT's position ids (node ``_positions``, layer wpe) come before ``wte`` in the traced graph: a cut between
    wte and wpe makes stage 1's first node precede stage 0's. split_module must order the stages by their
    dependencies, not by where their first node sits (it raised KeyError 'wte' with keep_original_order)."""
    model = GPT(n_layer=2, n_embd=8, n_head=2, vocab_size=32, block_size=12).double()
    lg = trace_layers(model)
    n = len(lg.names)  # wte, wpe, drop, blocks.0, blocks.1, ln_f, lm_head
    x = torch.randint(0, 32, (3, 7))
    want = model(x)
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            bounds = [0, *cuts, n]
            stages = split_stages(lg, list(zip(bounds, bounds[1:])))
            assert torch.equal(_run_stages(stages, {"idx": x}), want), bounds
    stages = split_stages(lg, [(0, 1), (1, n)])
    assert stages[0].inputs == ["idx"] and stages[1].inputs == ["idx"]  # both read the token ids


def test_long_skip_is_relayed_through_the_middle_stage():
    model = Skip().double()
    stages = split_stages(trace_layers(model), [(0, 1), (1, 2), (2, 4)])
    a0, a1 = "tanh", "tanh_1"  # fx names of tanh(l0(x)) and tanh(l1(a0))
    assert stages[0].send == [a0] and stages[1].recv == [a0]
    assert stages[1].send == [a0, a1] and stages[2].recv == [a0, a1]  # a0 relayed by stage 1
    x = torch.randn(5, 6, dtype=torch.float64)
    assert torch.allclose(_run_stages(stages, {"x": x}), model(x))


def test_parameter_used_directly_keeps_its_name():
    model = Scaled().double()
    stages = split_stages(trace_layers(model), [(0, 1), (1, 2)])
    assert {n for n, _ in stages[1].module.named_parameters()} == {"b.weight", "b.bias", "scale"}
    assert stages[1].module.get_parameter("scale") is model.scale
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(_run_stages(stages, {"x": x}), model(x))
