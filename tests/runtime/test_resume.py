"""Crash and resume loses nothing: a rank dies mid-step, or rank 0 dies while a save moves into place, the job is
relaunched from the last checkpoint, and it reaches the same losses, bit for bit, as a run that was never
interrupted (float64 with AdamW; fp16 with its loss scale, dropout, AdamW and an LR schedule)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import dapple
from dapple.models import GPT, lm_loss, random_tokens
from dapple.runtime import PipelineError
from dapple.runtime import checkpoint_files as files
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


# ---- rank 0 killed inside a save's swap; fp16, dropout, AdamW and a schedule resumed -----------------------
FP16_STEPS, KILLED_AT = 6, 4  # saves after steps 2, 4, 6; rank 0 dies moving step 4's into place


def fp16_job(root: str, resume: bool, die_saving_at: int | None = None) -> dict[str, Any] | None:
    """2 ranks, fp16 GPT with dropout, AdamW and a decaying LR, saving to root/ckpt every 2 steps (from the checkpoint
    there with ``resume``). ``die_saving_at``: rank 0 is killed (os._exit) inside that step's save, between
    setting the old checkpoint aside and moving the new one in (no atomic exchange, as on other systems)."""
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.2)
    pipe = dapple.pipeline(model, _plan(model, [((0, 4), [0]), ((4, 7), [1])], 4, 2), lm_loss, timeout=30,
                           mixed_precision="fp16")
    pipe.scaler.growth_interval = 1  # the scale moves every step: resuming with another one would show
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.8**epoch)  # a fresh one would restart at 1
    start, warned = 0, []
    if resume:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = dapple.load_checkpoint(f"{root}/ckpt", pipe, opt, scheduler=sched)["step"]
        warned = [str(w.message) for w in caught if "load_checkpoint" in str(w.message)]
    losses, scales = [], []
    for step in range(start + 1, FP16_STEPS + 1):
        losses.append(pipe.train_step(*random_tokens(4, 8, 32, generator=torch.Generator().manual_seed(step))))
        pipe.scaler.step(opt)
        pipe.scaler.update()
        sched.step()
        opt.zero_grad()
        scales.append((pipe.scaler.scale, opt.param_groups[0]["lr"]))
        if step % 2:
            continue
        if step == die_saving_at and rank == 0:
            files.exchange = lambda a, b: False
            moved = files.rename
            files.rename = lambda src, dst: os._exit(0) if src.name.endswith(files.SAVING) else moved(src, dst)
        try:
            dapple.save_checkpoint(f"{root}/ckpt", pipe, opt, {"step": step}, scheduler=sched)
        except PipelineError:  # rank 0 died in the save: this rank's job ends
            return {"losses": losses, "died_saving": step}
    return {"losses": losses, "scales": scales, "warned": warned}


def resume_and_reference(root: str) -> dict[str, Any]:
    """The killed job relaunched, then (same processes, seeded alike) a job that was never interrupted."""
    return {"resumed": fp16_job(f"{root}/job", True), "whole": fp16_job(f"{root}/whole", False)}


@pytest.mark.slow
def test_a_save_killed_while_moving_into_place_loses_nothing_and_fp16_resumes_bit_for_bit(tmp_path):
    killed = run_ranks(fp16_job, 2, str(tmp_path / "job"), False, KILLED_AT, timeout=180)
    assert killed[0] is None and killed[1]["died_saving"] == KILLED_AT, killed
    ckpt = tmp_path / "job" / "ckpt"
    assert not ckpt.exists() and files.replaced(ckpt).exists()  # killed between the two renames
    assert files.newest(ckpt) == files.Found(files.saving(ckpt), 2, KILLED_AT)  # the complete new one, found
    out = run_ranks(resume_and_reference, 2, str(tmp_path), timeout=180)
    whole, resumed = out[0]["whole"], [o["resumed"] for o in out]
    assert killed[1]["losses"] + resumed[1]["losses"] == whole["losses"]  # bit for bit
    assert resumed[0]["losses"] == resumed[1]["losses"] == whole["losses"][KILLED_AT:]
    # the loss scale and the learning rate went on from where they were (and they did move)
    assert resumed[0]["scales"] == whole["scales"][KILLED_AT:] and len(set(whole["scales"])) == FP16_STEPS
    assert resumed[0]["warned"] == [f"load_checkpoint: {ckpt} does not exist: reading {files.saving(ckpt)} (step "
                                    f"{KILLED_AT}), the newest complete checkpoint there (a save was interrupted "
                                    f"while moving it in place)"]
    assert resumed[1]["warned"] == []
    # the resumed job's saves moved the found one in place first, and left one complete checkpoint
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["ckpt"] and files.mark(ckpt)["step"] == FP16_STEPS
