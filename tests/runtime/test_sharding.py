"""ZeRO-1 (dapple.shard_optimizer), gloo, float64: sharded training equals unsharded training to the bit on a plan with
a replicated stage and a parameter tied across stages (AdamW in two groups, an LR schedule, gradient clipping, fp16's
skipped steps), holds 1/r of the optimizer state per replica, and its checkpoints load under another plan, sharded or
not, and go on to the bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dapple
from dapple.models import lm_loss
from dapple.runtime.sharding import partition
from tests.runtime._spawn import run_ranks
from tests.runtime.test_checkpoint import TOL, adamw, batch, gpt, pack, plan_for, unpack

# GPT layers: wte, wpe, drop, blocks.0, blocks.1, ln_f, lm_head (lm_head tied to wte)
PLAN_A = [((0, 5), [0, 1]), ((5, 7), [2])]  # stage 0 on 2 replicas; the tied weight on both stages
PLAN_B = [((0, 4), [0]), ((4, 7), [1, 2])]  # the other stage replicated: the checkpoint is resharded
SAVED_AT, MORE = 3, 2
CLIP = 0.05  # below the gradients' norm: every step clips


def _groups(pipe: dapple.Pipeline) -> list[dict]:
    named = list(pipe.named_parameters())  # nanoGPT's two groups, as test_checkpoint.adamw makes them
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


def _optimizer(pipe: dapple.Pipeline, sharded: bool) -> torch.optim.Optimizer:
    return dapple.shard_optimizer(pipe, torch.optim.AdamW, _groups(pipe), lr=1e-2) if sharded else \
        adamw(pipe.named_parameters())


def _train(pipe: dapple.Pipeline, opt: torch.optim.Optimizer, sched: Any, steps: range) -> list[float]:
    losses = []
    for step in steps:
        losses.append(pipe.train_step(*batch(step)))
        pipe.clip_grad_norm_(CLIP)
        pipe.scaler.step(opt)
        pipe.scaler.update()
        sched.step()
        opt.zero_grad()
    return losses


def _state(pipe: dapple.Pipeline, opt: torch.optim.Optimizer) -> dict:
    """Parameters and the optimizer state this rank holds, by name; the lr of each parameter's group."""
    lr = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    return {"params": {n: p.detach().clone() for n, p in pipe.named_parameters()},
            "state": {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in pipe.named_parameters()
                      if p in opt.state},
            "lr": {n: lr[id(p)] for n, p in pipe.named_parameters()}}


def _bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def _run_plan_a(pipe: dapple.Pipeline, root: str, sharded: bool) -> dict:
    """5 steps on plan A from the model's initial values (a checkpoint after 3 when sharded)."""
    opt = _optimizer(pipe, sharded)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = _train(pipe, opt, sched, range(SAVED_AT))
    at_save = _state(pipe, opt)
    if sharded:
        dapple.save_checkpoint(f"{root}/zero_a", pipe, opt, scheduler=sched)
    losses += _train(pipe, opt, sched, range(SAVED_AT, SAVED_AT + MORE))
    return {"losses": losses, "at_save": at_save, "end": _state(pipe, opt), "bytes": _bytes(opt)}


def _resume_plan_b(pipe: dapple.Pipeline, root: str, sharded: bool) -> dict:
    opt = _optimizer(pipe, sharded)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    dapple.load_checkpoint(f"{root}/zero_a", pipe, opt, scheduler=sched)
    loaded = _state(pipe, opt)
    if sharded:
        dapple.save_checkpoint(f"{root}/zero_b", pipe, opt, scheduler=sched)  # sharded again, another plan
    losses = _train(pipe, opt, sched, range(SAVED_AT, SAVED_AT + MORE))
    return {"losses": losses, "loaded": loaded, "end": _state(pipe, opt)}


def fp16_skips(model: torch.nn.Module) -> dict:
    """fp16 on plan A: a step whose scaled gradients overflow is skipped by every rank alike, sharded or not."""
    pipe = dapple.pipeline(model, plan_for(model, PLAN_A), lm_loss, timeout=30, mixed_precision="fp16")
    initial = {k: v.clone() for k, v in pipe.state_dict().items()}
    out = {}
    for sharded in (False, True):
        pipe.load_state_dict(initial)
        pipe.scaler.scale, pipe.scaler.found_inf = 2.0**16, False
        opt = _optimizer(pipe, sharded)
        before, stepped = None, []
        for step in range(3):
            if step == 1:  # a scale that overflows fp16's gradients
                pipe.scaler.scale, before = 2.0**60, {n: p.detach().clone() for n, p in pipe.named_parameters()}
            pipe.train_step(*batch(step))
            stepped.append(pipe.scaler.step(opt))
            pipe.scaler.update()
            if step == 1:
                out[f"unchanged_{sharded}"] = all(torch.equal(p, before[n]) for n, p in pipe.named_parameters())
                pipe.scaler.scale = 2.0**16
            opt.zero_grad()
        out[f"stepped_{sharded}"] = stepped
        out[f"params_{sharded}"] = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    return out


def zero_ranks(root: str) -> bytes:
    """World 3: plan A unsharded, then sharded (saved after 3 steps); plan B resumed from it sharded, then unsharded;
    fp16 on plan A."""
    out: dict[str, Any] = {}
    model = gpt()
    pipe = dapple.pipeline(model, plan_for(model, PLAN_A), lm_loss, timeout=30)
    initial = {k: v.clone() for k, v in pipe.state_dict().items()}
    for sharded in (False, True):
        pipe.load_state_dict(initial)
        pipe.step = 0
        out[f"a_{sharded}"] = _run_plan_a(pipe, root, sharded)
    model = gpt()
    pipe = dapple.pipeline(model, plan_for(model, PLAN_B), lm_loss, timeout=30)
    for sharded in (True, False):
        out[f"b_{sharded}"] = _resume_plan_b(pipe, root, sharded)
    out["fp16"] = fp16_skips(gpt().float())  # (autocast leaves float64 alone)
    out["stage"], out["replica"] = pipe.stage, pipe.replica
    return pack(out)


@pytest.fixture(scope="module")
def zero(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("zero")
    return {"root": root, "ranks": [unpack(b) for b in run_ranks(zero_ranks, 3, str(root), timeout=240)]}


@pytest.fixture(scope="module")
def single() -> list[float]:
    """Uninterrupted single-process training (AdamW, the schedule, clipping): the losses of all 5 steps."""
    model = gpt()
    opt = adamw(model.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = []
    for step in range(SAVED_AT + MORE):
        loss = lm_loss(model(batch(step)[0]), batch(step)[1])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        losses.append(float(loss.detach()))
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sharded_training_is_unsharded_training_to_the_bit(zero, single):
    ranks = zero["ranks"]
    for rank, r in enumerate(ranks):
        plain, sharded = r["a_False"], r["a_True"]
        assert sharded["losses"] == plain["losses"], rank
        assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(plain["losses"], single)), (rank, plain["losses"])
        assert _same(sharded["end"]["params"], plain["end"]["params"]), rank
        assert sharded["end"]["lr"] == plain["end"]["lr"] == {n: 2.5e-3 for n in plain["end"]["lr"]}, rank
        for n, st in sharded["end"]["state"].items():  # the state this replica holds is the unsharded state
            assert _same(st, plain["end"]["state"][n]), (rank, n)
    # the tied weight: stepped by one replica of stage 0 and by stage 1, equal on every rank
    wte = [r["a_True"]["end"]["params"]["wte.weight"] for r in ranks]
    assert all(torch.equal(w, wte[0]) for w in wte)
    # stage 0's replicas hold disjoint shares of its state, together all of it, each about half
    held = [set(r["a_True"]["end"]["state"]) for r in ranks[:2]]
    assert not held[0] & held[1] and held[0] | held[1] == set(ranks[0]["a_False"]["end"]["state"])
    whole = ranks[0]["a_False"]["bytes"]
    assert sum(r["a_True"]["bytes"] for r in ranks[:2]) == whole
    largest = max(2 * p.numel() * p.element_size() for p in gpt().parameters())  # Adam: two moments
    assert all(r["a_True"]["bytes"] <= whole / 2 + largest for r in ranks[:2]), [r["a_True"]["bytes"] for r in ranks]
    assert ranks[2]["a_True"]["bytes"] == ranks[2]["a_False"]["bytes"]  # one replica: everything


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_under_another_plan_sharded_or_not(zero, single):
    ranks = zero["ranks"]
    saved_params, saved_state = {}, {}
    for r in ranks:  # plan A's state at the save, unsharded (equal to the sharded run's)
        saved_params.update(r["a_False"]["at_save"]["params"])
        saved_state.update(r["a_False"]["at_save"]["state"])
    for rank, r in enumerate(ranks):
        for sharded in (True, False):
            loaded = r[f"b_{sharded}"]["loaded"]
            assert all(torch.equal(p, saved_params[n]) for n, p in loaded["params"].items()), (rank, sharded)
            for n, st in loaded["state"].items():  # what this rank holds (sharded: what it owns) is what was saved
                assert _same(st, saved_state[n]), (rank, sharded, n)
            assert loaded["lr"] == {n: 5e-3 for n in loaded["lr"]}  # the schedule's, after 3 steps
        held = set(r["b_True"]["loaded"]["state"])
        assert held < set(r["b_False"]["loaded"]["state"]) or r["stage"] == 0, rank  # stage 1 (x2): a share
        # resharded, sharded and unsharded go on to the bit alike, and as uninterrupted training
        assert r["b_True"]["losses"] == r["b_False"]["losses"], rank
        assert _same(r["b_True"]["end"]["params"], r["b_False"]["end"]["params"]), rank
        assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(r["b_True"]["losses"], single[SAVED_AT:])), rank
    # plan B's stage 1 replicas together hold the whole state of the stage
    b_held = [set(r["b_True"]["loaded"]["state"]) for r in ranks[1:]]
    assert set().union(*b_held) == set(ranks[1]["b_False"]["loaded"]["state"])
    assert sum(len(h) for h in b_held) == len(set().union(*b_held))
    # the description lists every parameter's state, though each replica wrote only its share
    from dapple.runtime.checkpoint import _read_meta
    for name in ("zero_a", "zero_b"):
        _, meta = _read_meta(zero["root"] / name)
        opt = meta["optimizer"]
        assert opt["class"] == "torch.optim.adamw.AdamW", name
        assert {n: set(k) for n, k in opt["state"].items()} == {
            n: {"step", "exp_avg", "exp_avg_sq"} for n, _ in gpt().named_parameters()}, name


@pytest.mark.slow
def test_fp16_skips_an_overflowing_step_on_every_rank_sharded_or_not(zero):
    for rank, r in enumerate(zero["ranks"]):
        f = r["fp16"]
        assert f["stepped_False"] == f["stepped_True"] == [True, False, True], rank
        assert f["unchanged_False"] and f["unchanged_True"], rank
        assert _same(f["params_True"], f["params_False"]), rank


def test_partition_balances_bytes_and_is_the_same_everywhere():
    sizes = [("a", 100), ("b", 60), ("c", 50), ("d", 40), ("e", 10), ("f", 0)]
    owner = partition(sizes, 2)
    loads = [sum(s for n, s in sizes if owner[n] == i) for i in range(2)]
    assert owner == partition(list(reversed(sizes)), 2)  # by name and size, not by order given
    assert sorted(loads) == [120, 140]  # largest first, each to the lightest: within one item of even
    assert set(partition(sizes, 1).values()) == {0}
    assert set(partition(sizes, 8).values()) <= set(range(8))


def test_shard_optimizer_checks_its_arguments():
    with pytest.raises(TypeError, match="pipe: expected a dapple.Pipeline"):
        dapple.shard_optimizer(torch.nn.Linear(2, 2), torch.optim.AdamW)
