"""`dapple profile module:factory ...`: end to end, in process and as a real subprocess; bad specs explained."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dapple import Profile
from dapple.cli import load_example, main
from tests.conftest import ROOT, needs_export

FAST = ["--repeats", "1", "--warmup", "0", "--device", "cpu"]


def test_profile_gpt_with_model_args(tmp_path, capsys):
    out = tmp_path / "gpt.profile.yaml"
    assert main(["profile", "examples.models:gpt", "--batch-sizes", "2", "4", "-o", str(out), *FAST,
                 "--model-arg", "n_layer=2", "--model-arg", "n_embd=16", "--model-arg", "seq=8"]) == 0
    prof = Profile.load(out)
    assert prof.model == "GPT-2x16" and prof.batch_sizes == [2, 4]
    assert prof.layer_names == ["wte", "wpe", "drop", "blocks.0", "blocks.1", "ln_f", "lm_head"]
    assert prof.layers[3].boundary_bytes == [2 * 8 * 16 * 4, 4 * 8 * 16 * 4]
    printed = capsys.readouterr().out
    assert "Profile of GPT-2x16" in printed and f"wrote {out}" in printed


def test_profile_file_spec_runs_as_a_subprocess(tmp_path):
    out = tmp_path / "emu.yaml"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "dapple.cli", "profile", "examples/models.py:emulated",
                        "--batch-sizes", "3", "-o", str(out), "--quiet", *FAST,
                        "--model-arg", "ms_per_row=(0.0, 0.0, 0.0)"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "examples/models.py not found" in r.stderr  # relative to the cwd
    r = subprocess.run([sys.executable, "-m", "dapple.cli", "profile", f"{ROOT}/examples/models.py:emulated",
                        "--batch-sizes", "3", "-o", str(out), "--quiet", *FAST,
                        "--model-arg", "ms_per_row=(0.0, 0.0, 0.0)"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert Profile.load(out).layer_names == ["layers.0", "layers.1", "layers.2", "head"]


@pytest.mark.parametrize("spec, args, message", [
    ("examples.models", [], "expected a model spec 'module:factory'"),
    ("examples.nothing:gpt", [], "cannot import examples.nothing"),
    ("examples.models:nope", [], "has no callable 'nope'"),
    ("examples.models:gpt", ["n_layers=2"], "bad --model-arg for gpt()"),
    ("examples.models:gpt", ["2"], "expects KEY=VALUE"),
    ("dapple.models:GPT", [], "without ['model', 'batch', 'loss_fn']"),
])
def test_bad_specs_say_what_is_wrong(spec, args, message):
    with pytest.raises(SystemExit) as e:
        load_example(spec, args)
    assert message in str(e.value)


def test_example_factories_make_batches_of_the_asked_size():
    for spec, args in [("examples.models:gpt", ["n_layer=1", "seq=8"]), ("examples.models:resnet", ["widths=(4,)"]),
                       ("examples.models:emulated", ["ms_per_row=(0.0,)"])]:
        ex = load_example(spec, args)
        x, y = ex.batch(3)
        assert x.shape[0] == 3 and y.shape[0] == 3
        loss = ex.loss_fn(ex.model(x), y)
        assert loss.dim() == 0 and loss.requires_grad


@needs_export
def test_profile_with_trace_export(tmp_path):
    out = tmp_path / "gpt.profile.yaml"
    assert main(["profile", "examples.models:gpt", "--batch-sizes", "2", "-o", str(out), *FAST, "--quiet",
                 "--tracer", "export", "--model-arg", "n_layer=1", "--model-arg", "n_embd=16",
                 "--model-arg", "seq=8"]) == 0
    prof = Profile.load(out)
    assert prof.meta["tracer"] == "export" and prof.layer_names == ["wte", "wpe", "drop", "blocks.0", "ln_f", "lm_head"]


def test_profile_layers_by_module_path(tmp_path):
    out = tmp_path / "gpt.profile.yaml"
    args = ["profile", "examples.models:gpt", "--batch-sizes", "2", *FAST, "--quiet", "--model-arg", "n_layer=2",
            "--model-arg", "n_embd=16", "--model-arg", "seq=8"]
    assert main([*args, "-o", str(out), "--layers", "wte", "blocks.0", "blocks.1", "lm_head"]) == 0
    prof = Profile.load(out)
    assert prof.layer_names == ["wte", "blocks.0", "blocks.1", "lm_head"]  # wpe joins wte, ln_f joins blocks.1
    assert prof.meta["layering"] == {"rule": "given", "layers": ["wte", "blocks.0", "blocks.1", "lm_head"]}
    with pytest.raises(SystemExit, match=r"dapple profile: layers: 'blocks.9' is not a submodule of GPT"):
        main([*args, "--layers", "wte", "blocks.9"])
