"""Profiling a meta-device model: one layer real at a time, the real model's sizes, repeated blocks timed once; tracing
a meta model allocates nothing and profiling peaks well below the model's bytes (a fresh process, its RSS)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dapple
from dapple.models import GPT, Llama, LlamaConfig, lm_loss, random_tokens
from dapple.profiler import trace_layers
from dapple.profiler.meta_measure import structure
from dapple.profiler.record import layer_module

ROOT = Path(__file__).resolve().parents[2]


def _sizes(prof: dapple.Profile) -> list[tuple]:
    return [(layer.name, layer.param_bytes, layer.boundary_bytes, layer.saved_bytes, layer.inputs)
            for layer in prof.layers]


@pytest.mark.parametrize("make", [lambda: GPT(n_layer=3, n_embd=32),
                                  lambda: Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                            num_hidden_layers=3, num_attention_heads=4,
                                                            num_key_value_heads=2, tie_word_embeddings=True))])
def test_a_meta_model_profiles_to_the_real_models_sizes(make):
    x, y = random_tokens(4, 8, 64)
    real = make()
    with torch.device("meta"):
        meta = make()
    kw = dict(targets=y, batch_sizes=(2, 4), repeats=1, warmup=0)
    got, want = dapple.profile(meta, x, lm_loss, **kw), dapple.profile(real, x, lm_loss, **kw)
    assert _sizes(got) == _sizes(want)
    blocks = [n for n in got.layer_names if n.startswith(("blocks.", "model.layers."))]
    assert got.meta["materialised"] == "one layer at a time"
    assert got.meta["reused"] == {n: blocks[0] for n in blocks[1:]}  # the blocks after the first take its times
    assert all(layer.forward_ms[0] > 0 and layer.backward_ms[0] > 0 for layer in got.layers
               if layer.name in blocks)
    assert all(t.is_meta for t in meta.parameters())  # every layer was freed again


def test_layers_that_differ_are_timed_apart():
    with torch.device("meta"):
        model = GPT(n_layer=2, n_embd=32)
    lg = trace_layers(model)
    k = lg.names.index("blocks.0")
    x = torch.zeros(2, 8, 32, requires_grad=True)
    a, b = layer_module(lg, k), layer_module(lg, k + 1)
    reads = [{a.inputs[0]: x, b.inputs[0]: x}]
    assert structure(a, "blocks.0", reads) == structure(b, "blocks.1", reads)
    wider = [{a.inputs[0]: torch.zeros(2, 9, 32, requires_grad=True), b.inputs[0]: x}]
    assert structure(a, "blocks.0", wider) != structure(b, "blocks.1", wider)  # inputs of another shape
    norm = layer_module(lg, lg.names.index("ln_f"))
    assert structure(norm, "ln_f", [{norm.inputs[0]: x}]) != structure(b, "blocks.1", reads)


def test_check_step_needs_a_real_model():
    with torch.device("meta"):
        model = GPT(n_layer=1, n_embd=16)
    x, y = random_tokens(2, 8, 512)
    with pytest.raises(ValueError, match="check_step"):
        dapple.profile(model, x, lm_loss, targets=y, check_step=True)


PEAK = """
import json, re, sys, torch, dapple
from dapple.models import GPT, lm_loss, random_tokens
from dapple.profiler import trace_layers

def peak():  # bytes: the high-water mark of this process's resident memory since the last reset
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

def reset():
    open("/proc/self/clear_refs", "w").write("5")  # the high-water mark back to the current RSS
    return peak()

torch.set_num_threads(1)
with torch.device("meta"):
    model = GPT(n_layer=12, n_embd=768, vocab_size=4096, block_size=64)
x, y = random_tokens(2, 16, 4096)
out = {"model": sum(p.numel() * p.element_size() for p in model.parameters())}
for method in ("fx", "export"):
    base = reset()
    trace_layers(model, method=method, example_inputs=(x,))
    out[method] = peak() - base
base = reset()
dapple.profile(model, x, lm_loss, targets=y, batch_sizes=(1, 2), repeats=1, warmup=0)
out["profile"] = peak() - base
print(json.dumps(out))
"""


def test_tracing_allocates_nothing_and_profiling_peaks_below_half_the_model():
    """A 350 MB GPT (12 blocks of 28 MB): tracing it (fx, export) grows the process by a few MB of graph, and
    profiling by about one block's parameters and gradients, not the model."""
    try:
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        pytest.skip("needs Linux's /proc/self/clear_refs to measure a peak")
    run = subprocess.run([sys.executable, "-c", PEAK], cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["model"] > 340e6
    assert r["fx"] < 0.02 * r["model"] and r["export"] < 0.1 * r["model"], r
    assert r["profile"] < 0.5 * r["model"], r
