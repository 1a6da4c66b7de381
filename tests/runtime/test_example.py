"""The examples stay true: the GPT example's committed plan file is the one its --write-plan makes for its model;
the CNN example loads per rank and matches the global batch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import dapple

ROOT = Path(__file__).resolve().parents[2]


def test_example_plan_matches_the_example_model(tmp_path):
    out = tmp_path / "plan.yaml"
    subprocess.run([sys.executable, "examples/train_gpt.py", "--write-plan", str(out)], cwd=ROOT, check=True,
                   capture_output=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    made, committed = dapple.Plan.load(out), dapple.Plan.load(ROOT / "examples" / "gpt_plan.yaml")
    assert made.to_dict() == committed.to_dict()
    assert committed.num_devices == 4 and committed.layer_names[-1] == "lm_head"


@pytest.mark.slow
def test_cnn_example_loads_per_rank_and_matches_the_global_batch():
    """examples/train_cnn.py on 4 processes: each rank's own rows give the global batch's validation loss; stage
    0's replicas pass half the images each, the middle stage nothing, the last stage only the labels."""
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                          "examples/train_cnn.py", "--steps", "2", "--rows", "64"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-8000:]  # the failing rank's traceback
    out = run.stdout
    losses = re.search(r"global batch (\S+), own rows (\S+)", out)
    assert losses and losses[1] == losses[2], out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d\s+\d\s+\d\s+\d+\s", line)]
    assert [(r[0], r[3], r[4], r[5], r[6]) for r in rows] == [  # rank, rows, bytes: global batch, own rows; reads
        ("0", "16", "393,472", "196,736", "32"), ("1", "16", "393,472", "196,736", "32"),
        ("2", "0", "393,472", "0", "0"), ("3", "32", "393,472", "512", "64")], out


@pytest.mark.slow
def test_large_example_trains_a_pretrained_checkpoint_stage_by_stage(tmp_path):
    """examples/train_large.py on 2 processes with a sharded transformers checkpoint: planned as 2 stages from the
    meta model's profile, each rank reads only the shards of its stage, and the first step's loss is the pretrained
    model's on that batch."""
    transformers = pytest.importorskip("transformers")
    import torch
    import torch.nn.functional as F

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "pretrained", max_shard_size="40KB")
    shards = len(list((tmp_path / "pretrained").glob("*.safetensors")))
    batch = torch.randint(0, 128, (4 * 2, 16), generator=torch.Generator().manual_seed(1))[:4]
    with torch.no_grad():
        want = F.cross_entropy(model(batch).logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "examples/train_large.py", "--checkpoint", str(tmp_path / "pretrained"), "--plan",
                          str(tmp_path / "plan.yaml"), "--steps", "2", "--batch", "4", "--seq", "16",
                          "--device-memory", "600000", "--save", str(tmp_path / "ckpt")], cwd=ROOT,
                         capture_output=True, text=True, timeout=240,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-8000:]
    assert dapple.Plan.load(tmp_path / "plan.yaml").num_stages == 2
    read = r"rank \d \(stage \d\): read \d+ tensors, [\d.]+ MiB from (\d+) file"
    files = [int(f) for f in re.findall(read, run.stdout)]
    assert len(files) == 2 and all(f < shards for f in files), run.stdout  # neither rank opened every shard
    assert f"step 1: loss {float(want):.4f}" in run.stdout, (float(want), run.stdout)
    transformers.LlamaForCausalLM(config).load_state_dict(dapple.load_full_state_dict(tmp_path / "ckpt"))  # strict
