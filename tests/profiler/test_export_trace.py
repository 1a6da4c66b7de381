"""torch.export tracing: a nanoGPT-style model fx cannot trace, dynamic batch and sequence, exact grads, guards."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.split_module import split_module

import dapple
from dapple.profiler import TraceError, trace_layers
from dapple.profiler.export_graph import module_path, retarget_devices
from dapple.profiler.record import layer_module
from tests.conftest import needs_export
from tests.nanogpt import EMBD, VOCAB, NanoGPT

pytestmark = needs_export


NAMES = ["wte", "wpe", "drop", "h.0", "h.1", "ln_f", "lm_head"]


def tokens(b: int, t: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return NanoGPT().double()


@pytest.fixture(scope="module")
def traced(model):
    # a view as example (as random token batches are): export would guard on its base; dapple traces a copy
    return trace_layers(model, tracer="export", example_inputs=tokens(4, 13)[:, :-1])


def _check_monotone(lg):
    for n, k in lg.layer_of.items():
        assert all(u.op == "output" or lg.layer_of[u] >= k for u in n.users), n.name


def test_fx_fails_on_the_assert_and_auto_says_what_to_pass(model):
    with pytest.raises(TraceError, match=r"could not trace NanoGPT(.|\n)*assert t <= BLOCK"):
        trace_layers(model, tracer="fx")
    with pytest.raises(TraceError, match=r"^torch.fx could not trace NanoGPT; torch.export may: pass example_inputs="
                                         r".* with tracer='auto' or 'export'(.|\n)*assert t <= BLOCK"):
        trace_layers(model)  # auto without example inputs: how to get the export path first, then the fx error


def test_export_and_auto_give_the_layers_fx_gives_without_the_assert(model, traced):
    auto = trace_layers(model, example_inputs=tokens(2, 8))
    fx_names = trace_layers(NanoGPT(check=False), concrete_args={"targets": None}).names
    assert traced.names == auto.names == fx_names == NAMES
    assert auto.gm.meta["dapple_trace"]["method"] == "export" and traced.inputs == ["idx"]
    _check_monotone(traced)


@pytest.mark.parametrize("b, t", [(3, 8), (5, 8), (3, 20), (5, 20)])
def test_graph_gives_the_models_output_and_gradients_for_other_batch_and_sequence(model, traced, b, t):
    x = tokens(b, t)
    weights = torch.randn(b, t, VOCAB, dtype=torch.float64)  # d(loss)/d(logits)
    params = list(model.parameters())
    expected = model(x)
    want = torch.autograd.grad((expected * weights).sum(), params)
    got_out = traced.gm(x)
    got = torch.autograd.grad((got_out * weights).sum(), params)  # the graph holds the model's own parameters
    assert torch.equal(got_out, expected)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_sizes_are_read_inside_each_block_and_only_tensors_cross(traced):
    for k, name in enumerate(traced.names):
        reads = {a.op for a in layer_module(traced, k).inputs}
        if name.startswith("h."):  # batch and sequence length come from the block's own input
            assert reads == {"call_function"}
    for k in range(traced.num_layers - 1):
        for n in traced.crossing(k):
            val = n.meta["val"]
            assert isinstance(val, torch.Tensor) and not isinstance(val.shape[0], int), n.name  # rows dynamic


def test_params_by_layer_counts_the_tied_embedding_once(model, traced):
    params = traced.params_by_layer()
    flat = [p for ps in params for _, p in ps]
    assert len({id(p) for p in flat}) == len(flat)
    assert sum(p.numel() * p.element_size() for p in flat) == sum(
        p.numel() * p.element_size() for p in model.parameters())
    names = [[n for n, _ in ps] for ps in params]
    assert names[0] == ["wte.weight"] and names[-1] == []  # the head's weight is the embedding's, under its name
    assert set(sum(names, [])) <= dict(model.named_parameters()).keys()


def test_split_module_at_a_block_boundary_chains_to_the_output(model, traced):
    cut = traced.names.index("h.0")  # stage 0: embeddings + h.0; stage 1: h.1 onwards
    parts = split_module(traced.gm, None, lambda n: int(traced.layer_of[n] > cut), keep_original_order=True)
    stage1 = [n for n in parts.submod_1.graph.nodes if n.op == "placeholder"]
    received = [n.name for n in stage1 if not n.name.startswith(("h_1_", "ln_f_", "lm_head_"))]
    assert received == [n.name for n in traced.crossing(cut)] == ["add_2"]  # one activation, no size, no idx
    for b, t in ((2, 5), (1, 17)):  # one row: export traced with >= 2, and still runs it
        x = tokens(b, t)
        assert torch.equal(parts(x), model(x))


def test_meta_device_propagation_for_any_rows(traced):
    gm = traced.gm
    assert retarget_devices(gm, "meta") == 1  # the position arange was traced on the cpu
    try:
        state = {k: torch.empty_like(v, device="meta") for k, v in gm.state_dict().items()}
        out = torch.func.functional_call(gm, state, (torch.zeros(7, 9, dtype=torch.long, device="meta"),))
        assert out.shape == (7, 9, VOCAB)
    finally:
        assert retarget_devices(gm, "cpu") == 1


def test_buffer_slicing_attention_fx_cannot_trace_exports_too():
    m = NanoGPT(flash=False, check=False).double()
    with pytest.raises(TraceError, match=r"self.bias\[:, :, :T, :T\]"):
        trace_layers(m, tracer="fx", concrete_args={"targets": None})
    lg = trace_layers(m, example_inputs=tokens(2, 6), concrete_args={"targets": None})  # fx fails: auto exports
    assert lg.names == NAMES and lg.inputs == ["idx", "targets"]
    assert [n.args for n in lg.gm.graph.nodes if n.op == "placeholder"] == [(), (None,)]  # a default, as in fx
    x = tokens(3, 11)
    assert torch.equal(lg.gm(x), m(x))


def test_dropout_draws_the_same_masks_and_export_leaves_the_model_as_it_was():
    m = NanoGPT(dropout=0.2).double().eval()
    lg = trace_layers(m, tracer="export", example_inputs=tokens(2, 6))
    assert not m.training  # exported in training mode, flags restored
    x = tokens(3, 10)
    torch.manual_seed(5)
    got = lg.gm(x)
    torch.manual_seed(5)
    assert torch.equal(got, m.train()(x)) and not torch.equal(got, m.eval()(x))


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.act, self.fc = nn.ReLU(inplace=True), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.act(self.bn(self.conv(x))).mean((2, 3)))


def test_batchnorm_updates_the_models_running_statistics_like_eager():
    m = ConvBN().double()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    lg = trace_layers(m, tracer="export", example_inputs=torch.randn(4, 3, 8, 8, dtype=torch.float64),
                      dynamic_shapes=[{2: torch.export.Dim.AUTO, 3: torch.export.Dim.AUTO}])
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())  # export itself changes nothing
    assert lg.names == ["conv", "bn", "act", "fc"]
    x = torch.randn(5, 3, 10, 9, dtype=torch.float64)
    out = lg.gm(x)
    after_graph = {k: v.clone() for k, v in m.state_dict().items()}
    m.load_state_dict(before)
    assert torch.equal(out, m.train()(x))
    assert all(torch.equal(v, after_graph[k]) for k, v in m.state_dict().items())
    assert m.bn.num_batches_tracked.item() == 1


class SeqBranch(nn.Module):
    """Python control flow on the sequence length: export keeps the branch it saw and guards the condition."""

    def __init__(self, equal: bool):
        super().__init__()
        self.equal, self.a, self.b = equal, nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):  # (B, T, 4)
        if (x.shape[1] == 16) if self.equal else (x.shape[1] > 8):
            return self.a(x)
        return self.b(x)


def test_shape_branch_is_specialised_and_guarded():
    with pytest.warns(UserWarning, match=r"fixed sizes only: x dim 2 = 4 "):  # the Linear's features
        lg = trace_layers(SeqBranch(equal=False), example_inputs=torch.randn(2, 16, 4))  # fx fails: auto exports
    assert lg.names == ["a"]  # only the branch taken at trace time is in the graph
    lg.gm(torch.randn(3, 12, 4))  # T > 8: same branch, runs
    with pytest.raises(AssertionError, match=r"Guard failed: x.size\(\)\[1\] >= 9"):
        lg.gm(torch.randn(3, 4, 4))  # the other branch: refused, not silently wrong
    with pytest.warns(UserWarning, match=r"fixed sizes only: x dim 1 = 16, x dim 2 = 4"):
        fixed = trace_layers(SeqBranch(equal=True), example_inputs=torch.randn(2, 16, 4))
    fixed.gm(torch.randn(1, 16, 4))  # a one-row slice is fine
    with pytest.raises(AssertionError, match=r"Guard failed: x.size\(\)\[1\] == 16"):
        fixed.gm(torch.randn(2, 12, 4))


class BatchParity(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h * 2 if x.shape[0] % 2 == 0 else h)


class FixedBatch(BatchParity):
    def forward(self, x):
        return self.b(self.a(x).reshape(4, 2, 4).sum(1))


def test_batch_branch_warns_and_fixed_batch_is_refused():
    with pytest.warns(UserWarning, match=r"size\(\)\[0\] % 2\) == 0 about the batch size"):
        lg = trace_layers(BatchParity(), tracer="export", example_inputs=torch.randn(4, 4),
                          dynamic_shapes=[{1: None}])
    lg.gm(torch.randn(6, 4))
    with pytest.raises(AssertionError, match="Guard failed"):
        lg.gm(torch.randn(3, 4))
    with pytest.raises(TraceError, match=r"could not trace FixedBatch(.|\n)*batch dimension \(dim 0\)"):
        trace_layers(FixedBatch(), tracer="export", example_inputs=torch.randn(8, 4))
    with pytest.raises(ValueError, match="leaf_modules apply to torch.fx only"):
        trace_layers(BatchParity(), tracer="export", example_inputs=torch.randn(4, 4), leaf_modules=[nn.Linear])
    with pytest.raises(ValueError, match="tracer: expected one of"):
        trace_layers(BatchParity(), tracer="dynamo")


def test_profile_with_trace_export():
    m = NanoGPT()
    x, y = tokens(4, 8), tokens(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default dynamic dims need no warning for token inputs
        prof = dapple.profile(m, x, lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()), (2, 4),
                              targets=y, repeats=1, warmup=0, tracer="export")
    assert [layer.name for layer in prof.layers] == NAMES and prof.meta["tracer"] == "export"
    assert sum(layer.param_bytes for layer in prof.layers) == sum(p.numel() * 4 for p in m.parameters())
    block = prof.layers[NAMES.index("h.0")]
    assert block.boundary_bytes == [2 * 8 * EMBD * 4, 4 * 8 * EMBD * 4]
    assert all(f > 0 for layer in prof.layers[3:5] for f in layer.forward_ms + layer.backward_ms)


@pytest.mark.parametrize("path, expected", [
    ("blocks.0.attn", "blocks.0.attn"), ("L['self'].blocks[0].attn", "blocks.0.attn"),
    ("L['self']._modules['blocks']._modules['0']", "blocks.0"), ("getattr(L['self'].h, '3').mlp", "h.3.mlp"),
    ("self.selfattn", "selfattn"), ("", ""),
])
def test_module_paths_as_export_and_dynamo_spell_them(path, expected):
    assert module_path(path) == expected
