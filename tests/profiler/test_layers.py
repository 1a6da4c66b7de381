"""Layer grouping: module paths in execution order, valid cuts, copies of input-only nodes, params."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dapple.models import GPT, EmulatedNet, ResNet
from dapple.profiler import TraceError, trace_layers
from dapple.profiler.layers import arity
from dapple.profiler.units import find_blocks
from tests.conftest import EXPORT_OK


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


class Rotary(nn.Module):
    """A table computed from the sequence length alone (a rotary embedding's cos/sin): (T,) -> (T, 4)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 4))

    def forward(self, t):
        pos = torch.arange(t, device=self.freq.device, dtype=self.freq.dtype)
        return torch.cos(pos[:, None] * self.freq)


class TableBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, h, table):
        return torch.tanh(self.fc(h) + table)


class Body(nn.Module):
    def __init__(self, depth=3):
        super().__init__()
        self.embed, self.rotary, self.norm = nn.Linear(3, 4), Rotary(), nn.LayerNorm(4)
        self.blocks = nn.ModuleList([TableBlock() for _ in range(depth)])

    def forward(self, x):  # (B, T, 3) -> (B, T, 4)
        h = self.embed(x)
        table = self.rotary(x.size(1))
        for b in self.blocks:
            h = b(h, table)
        return self.norm(h)


class Wrapped(nn.Module):
    """A user's wrapper around a model whose blocks sit two levels down (body.blocks.i)."""

    def __init__(self, depth=3):
        super().__init__()
        self.body, self.head = Body(depth), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.body(x))


WRAPPED = ["body.embed", "body.blocks.0", "body.blocks.1", "body.blocks.2", "body.norm", "head"]


def test_blocks_at_any_depth_are_layers_and_a_table_from_sizes_is_computed_where_used():
    lg = trace_layers(Wrapped())
    assert lg.names == WRAPPED  # body.rotary: its table is computed in every block that uses it, not sent
    assert lg.layering.to_meta() == {"rule": "blocks", "blocks": ["body.blocks"]}
    _check_monotone(lg)
    crossing = [[n.name for n in lg.crossing(k)] for k in range(lg.num_layers - 1)]
    assert all(len(c) == 1 for c in crossing), crossing  # the hidden state only
    m = Wrapped().double()
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    assert torch.equal(trace_layers(m).gm(x), m(x))


@pytest.mark.skipif(not EXPORT_OK, reason="torch.export tracing needs torch >= 2.9")
def test_fx_and_export_give_the_same_layers_at_any_depth():
    m = Wrapped().double()
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    lg = trace_layers(m, tracer="export", example_inputs=x, dynamic_shapes=[{1: torch.export.Dim.AUTO}])
    assert lg.names == trace_layers(m, tracer="fx").names == WRAPPED
    _check_monotone(lg)
    for k in range(lg.num_layers - 1):
        assert [tuple(n.meta["val"].shape)[2:] for n in lg.crossing(k)] == [(4,)], k  # (B, T, 4) only
    assert torch.equal(lg.gm(torch.ones(3, 7, 3, dtype=torch.float64)), m(torch.ones(3, 7, 3, dtype=torch.float64)))


def test_find_blocks_takes_every_heavy_stack_and_skips_stacks_inside_blocks():
    class EncDec(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = Body(2)
            self.decoder = Body(3)
            self.extra = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))  # a stack, but a light one

    assert find_blocks(EncDec()) == ["encoder.blocks", "decoder.blocks"]
    assert find_blocks(GPT(n_layer=2)) == ["blocks"]  # not blocks.0.mlp (Linear, GELU, Linear): inside a block
    assert find_blocks(GPT(n_layer=1)) == ["blocks"]  # a list of one block is still the list of blocks
    assert find_blocks(nn.Linear(2, 2)) == []


def test_layers_given_by_path_override_the_rule_and_unlisted_operations_join_a_neighbour():
    lg = trace_layers(Wrapped(), layers=["body.blocks.0", "body.blocks.2", "head"])
    assert lg.names == ["body.blocks.0", "body.blocks.2", "head"]  # embed joins blocks.0, blocks.1 joins it too
    assert lg.layering.to_meta() == {"rule": "given", "layers": ["body.blocks.0", "body.blocks.2", "head"]}
    _check_monotone(lg)
    m = Wrapped().double()
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    assert torch.equal(trace_layers(m, layers=["body", "head"]).gm(x), m(x))


@pytest.mark.parametrize("layers, error", [
    ("head", r"layers: expected a non-empty list of module paths"),
    ([], r"layers: expected a non-empty list"),
    (["body.blocks.7"], r"layers: 'body.blocks.7' is not a submodule of Wrapped .*'body.blocks.0'"),
    (["body", "body.blocks.0"], r"layers: 'body' and 'body.blocks.0' overlap"),
])
def test_bad_layer_paths_are_named(layers, error):
    with pytest.raises((TypeError, ValueError), match=error):
        trace_layers(Wrapped(), layers=layers)


def test_method_is_the_deprecated_name_of_tracer():
    with pytest.warns(DeprecationWarning, match=r"trace_layers\(method=...\) is deprecated: pass tracer="):
        lg = trace_layers(Masked(), concrete_args={"mask": None}, method="fx")
    assert lg.names == ["a", "b"] and lg.gm.meta["dapple_trace"]["method"] == "fx"
