"""transformers' Llama built on the meta device, as torchtitan builds models (``torch.device("meta")``) and as
accelerate's ``init_empty_weights`` does (parameters on meta, buffers real): each of 2 ranks makes its stage real (the
rotary ``inv_freq`` computed again by the model's own ``_init_weights``), loads its shards of a ``save_pretrained``
checkpoint (embeddings tied across the stages) and trains as the full build does, in float64. dapple's own Llama
computes what transformers' does from the same weights."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dapple
import dapple.runtime.weight_files as weight_files
from dapple.planner import Plan, Stage
from tests.conftest import needs_export
from tests.runtime._spawn import run_ranks

transformers = pytest.importorskip("transformers")
pytestmark = needs_export

VOCAB, GBS, MBS = 64, 4, 2
STAGES = [Stage((0, 2), [0]), Stage((2, 5), [1])]  # embed_tokens layers.0 | layers.1 norm lm_head (tied)
TOL = 1e-12


def config() -> Any:
    return transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32,
                                    bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)


def full_model() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config()).double()


def loss_fn(out: Any, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


@contextlib.contextmanager
def init_empty_weights() -> Iterator[None]:
    """accelerate's ``init_empty_weights()`` (include_buffers=False): parameters registered on the meta device,
    buffers built where they are (here the CPU, so the rotary table is computed)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _rank(path: str) -> dict[str, Any]:
    model = full_model()
    tokens = torch.randint(0, VOCAB, (GBS, 8), generator=torch.Generator().manual_seed(1))
    ref = loss_fn(model(tokens), tokens)
    ref.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    want_freq = model.model.rotary_emb.inv_freq
    out: dict[str, Any] = {}
    for kind, build in (("meta", torch.device("meta")), ("empty", init_empty_weights())):
        with build:
            meta = transformers.LlamaForCausalLM(config()).double()
        meta.tie_weights()  # as after accelerate's init_empty_weights, whose new meta parameters untie them
        pipe = dapple.pipeline(meta, Plan(GBS, MBS, STAGES), loss_fn, example_inputs=(tokens,))
        freq = pipe.module.get_buffer("model.rotary_emb.inv_freq")  # before any loading: a non-persistent buffer
        opened = []
        real = weight_files.safe_open
        weight_files.safe_open = lambda f, *a, **k: (opened.append(Path(f).name), real(f, *a, **k))[1]
        try:
            dapple.load_weights(pipe, path)
        finally:
            weight_files.safe_open = real
        loss = pipe.train_step(tokens, tokens)
        out[kind] = {"loss": abs(loss - float(ref)), "freq": float((freq - want_freq).abs().max()),
                     "grads": max(float((p.grad - grads[n]).abs().max()) for n, p in pipe.named_parameters()),
                     "opened": sorted(set(opened)), "own": sorted(pipe.state_dict())}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_meta")
    full_model().save_pretrained(root, max_shard_size="20KB")  # several shards; lm_head.weight left out (tied)
    index = (root / "model.safetensors.index.json").read_text()
    return run_ranks(_rank, 2, str(root)), index


@pytest.mark.parametrize("kind", ["meta", "empty"])
@pytest.mark.slow
def test_meta_built_llama_with_pretrained_weights_trains_as_the_full_build(results, kind):
    ranks, _ = results
    for rank, r in enumerate(ranks):
        assert r[kind]["freq"] == 0.0, (kind, rank)  # the rotary table computed again (or kept) exactly
        assert r[kind]["loss"] <= TOL and r[kind]["grads"] <= TOL, (kind, rank, r[kind])


@pytest.mark.slow
def test_each_rank_opens_only_the_shards_holding_its_stage(results):
    import json

    ranks, index = results
    weight_map = json.loads(index)["weight_map"]
    for rank, r in enumerate(ranks):
        own = {k if k != "lm_head.weight" else "model.embed_tokens.weight" for k in r["meta"]["own"]}
        assert r["meta"]["opened"] == sorted({weight_map[k] for k in own}), rank
    assert len(set(weight_map.values())) > len(ranks[0]["meta"]["opened"])  # a shard rank 0 did not open


def test_dapple_llama_computes_what_transformers_llama_does():
    from dapple.models import Llama, LlamaConfig

    kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, rms_norm_eps=1e-6, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw, max_position_embeddings=32, bos_token_id=0,
                                                                eos_token_id=0)).double()
    ours = Llama(LlamaConfig(**kw)).double()
    ours.load_state_dict(hf.state_dict())  # strict: the same names
    x = torch.randint(0, VOCAB, (2, 10))
    assert torch.allclose(hf(x).logits, ours(x), atol=1e-6, rtol=0)  # transformers' RMSNorm rounds to float32
