"""Crash and resume loses nothing: a rank dies mid-step, the job is relaunched from the last save_checkpoint, and
it reaches the same losses as a run that was never interrupted (float64, AdamW state included)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dapple
from dapple.runtime import PipelineError
from tests.runtime._spawn import run_ranks
from tests.runtime.workers import Chain, _chain_data, _plan

STEPS, SAVE_EVERY, CRASH_AT = 6, 2, 5  # checkpoints after steps 2 and 4; rank 2 dies in step 5's forward
STAGES = [((0, 1), [0]), ((1, 3), [1, 2]), ((3, 5), [3])]


def train(root: str, crash: bool, resume: bool) -> list[float] | None:
    """Steps up to STEPS (from the last checkpoint with ``resume``); the losses seen, or None on the dead rank."""
    torch.manual_seed(0)
    model = Chain().double()
    pipe = dapple.pipeline(model, _plan(model, STAGES, 9, 3), F.cross_entropy, timeout=10)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.05)
    start = dapple.load_checkpoint(_latest(root), pipe, opt)["step"] if resume else 0
    if crash and int(os.environ["RANK"]) == 2:
        calls = [0]

        def die(module, args):  # os._exit: no goodbye to the peers, as a killed process
            calls[0] += 1
            if calls[0] > (CRASH_AT - 1) * 3:  # 3 micro-batches per step: the first forward of step CRASH_AT
                os._exit(0)
        pipe.module.register_forward_pre_hook(die)
    losses = []
    for step in range(start + 1, STEPS + 1):
        x, y = _chain_data(9, seed=step)
        try:
            losses.append(pipe.train_step(x, y))
        except PipelineError:
            return losses  # a peer died: this rank's job ends here
        opt.step()
        opt.zero_grad()
        if step % SAVE_EVERY == 0:
            dapple.save_checkpoint(f"{root}/ckpt{step}", pipe, opt, extra={"step": step})
    return losses


def _latest(root: str) -> str:
    return max((p for p in Path(root).iterdir() if p.name.startswith("ckpt")), key=lambda p: int(p.name[4:])).as_posix()


@pytest.mark.slow
def test_a_job_relaunched_after_a_crash_reaches_the_uninterrupted_losses(tmp_path):
    whole = run_ranks(train, 4, str(tmp_path / "whole"), False, False, timeout=180)[0]
    crashed = run_ranks(train, 4, str(tmp_path / "job"), True, False, timeout=180)
    assert crashed[2] is None and len(crashed[0]) == CRASH_AT - 1  # rank 2 vanished in step 5; rank 0 saw 1-4
    resumed = run_ranks(train, 4, str(tmp_path / "job"), False, True, timeout=180)[0]  # from ckpt4
    assert len(whole) == STEPS and len(resumed) == STEPS - 4
    assert crashed[0] + resumed == whole  # bit for bit: same data, same state, same order of operations
