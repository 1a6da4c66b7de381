"""The GPT example's committed plan file is the one its --write-plan makes for its model (no drift)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dapple

ROOT = Path(__file__).resolve().parents[2]


def test_example_plan_matches_the_example_model(tmp_path):
    out = tmp_path / "plan.yaml"
    subprocess.run([sys.executable, "examples/train_gpt.py", "--write-plan", str(out)], cwd=ROOT, check=True,
                   capture_output=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    made, committed = dapple.Plan.load(out), dapple.Plan.load(ROOT / "examples" / "gpt_plan.yaml")
    assert made.to_dict() == committed.to_dict()
    assert committed.num_devices == 4 and committed.layer_names[-1] == "lm_head"
