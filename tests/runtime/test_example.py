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
