"""Checkpoints (gloo, float64): save under one plan, resume under another plan and world size with the same
parameters, AdamW state and losses as uninterrupted single-process training; full state_dict; dedup; errors."""

from __future__ import annotations

import io
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import dapple
from dapple.models import GPT, ResNet, lm_loss, random_tokens
from dapple.planner import Plan, Stage
from dapple.profiler import trace_layers
from dapple.runtime.checkpoint_sync import checkpoint_group
from tests.runtime._spawn import STALL_LIMIT, reported, run_ranks, stall_until_reported

GBS, MBS, SEQ = 6, 3, 8
SAVED_AT, MORE = 3, 2  # train 3 steps, save; resume for 2 more
TOL = 1e-9
# GPT layers: wte, wpe, drop, blocks.0, blocks.1, ln_f, lm_head (lm_head tied to wte)
P1 = [((0, 4), [0]), ((4, 7), [1])]  # 2 ranks: straight, the tied weight on both stages
P2 = [((0, 5), [0, 1]), ((5, 7), [2])]  # 3 ranks: stage 0 replicated, tied weight on both stages
P3 = [((0, 7), [0, 1, 2])]  # 3 ranks: pure data parallelism


# ---- shared by the ranks and the single-process reference ----------------------------------------------
def gpt(**kw: Any) -> GPT:
    torch.manual_seed(0)
    return GPT(**{"vocab_size": 32, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 8, **kw}).double()


def plan_for(model: nn.Module, stages: list) -> Plan:
    return Plan(global_batch_size=GBS, micro_batch_size=MBS, stages=[Stage(span, d) for span, d in stages],
                layer_names=trace_layers(model).names)


def adamw(named: Any, lr: float = 1e-2) -> torch.optim.AdamW:
    """nanoGPT's two groups: weight decay on matrices only."""
    named = list(named)
    return torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}], lr=lr)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_tokens(GBS, SEQ, 32, generator=torch.Generator().manual_seed(step))


def snapshot(named: Any, opt: torch.optim.Optimizer) -> dict:
    """Parameters, AdamW state and hyperparameters by name (copies)."""
    named = list(named)
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    return {"params": {n: p.detach().clone() for n, p in named},
            "state": {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in named},
            "hyper": {n: (group_of[id(p)]["lr"], group_of[id(p)]["weight_decay"]) for n, p in named}}


def pack(obj: Any) -> bytes:  # tensors travel back from the ranks as bytes
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(b: bytes) -> Any:
    return torch.load(io.BytesIO(b), weights_only=False)


def fill_buffers(model: nn.Module, offset: float) -> None:
    """Deterministic, distinct values in every buffer (BatchNorm statistics), plus ``offset``."""
    with torch.no_grad():
        for i, (_, b) in enumerate(model.named_buffers()):
            b.copy_(torch.arange(b.numel()).reshape(b.shape) + 10 * i + offset)


def resnet() -> ResNet:
    torch.manual_seed(0)
    return ResNet(widths=(4, 8), depth=1, num_classes=3, norm="batch").double()


# ---- per-rank functions -------------------------------------------------------------------------------
def train_and_save(root: str) -> bytes:
    """World 2, plan P1: 3 AdamW steps, save; returns losses and the saved state of this rank."""
    model = gpt()
    pipe = dapple.pipeline(model, plan_for(model, P1), lm_loss, timeout=30)
    opt = adamw(pipe.named_parameters())
    losses = []
    for step in range(SAVED_AT):
        losses.append(pipe.train_step(*batch(step)))
        opt.step()
        opt.zero_grad()
    dapple.save_checkpoint(f"{root}/ckpt1", pipe, opt, extra={"data_step": SAVED_AT, "tag": torch.arange(3)})
    return pack({"losses": losses, **snapshot(pipe.named_parameters(), opt)})


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _without_rank_2(call: Any, key: str) -> tuple[float, str] | None:
    """Rank 2 stalls until the others have reported (seconds taken, error) of ``call`` (2 s timeout)."""
    if int(os.environ["RANK"]) == 2:
        stall_until_reported(key, 2)
        return None
    t0 = time.monotonic()
    msg = _error(call)
    seconds = time.monotonic() - t0
    reported(key)
    return seconds, msg


def resume(root: str) -> bytes:
    """World 3: resume ckpt1 under P2 (replicated stage) and P3 (pure DP); re-save; errors; a timeout."""
    out: dict[str, Any] = {}
    for label, stages in (("p2", P2), ("p3", P3)):
        model = gpt()
        pipe = dapple.pipeline(model, plan_for(model, stages), lm_loss, timeout=30)
        opt = adamw(pipe.named_parameters(), lr=0.5)  # wrong lr: the checkpoint's must win
        out[f"{label}_extra"] = dapple.load_checkpoint(f"{root}/ckpt1", pipe, opt)
        out[f"{label}_step"] = pipe.step
        out[f"{label}_loaded"] = snapshot(pipe.named_parameters(), opt)
        if label == "p2":  # re-save from 3 ranks with a replicated stage: dedup, and a round trip
            dapple.save_checkpoint(f"{root}/ckpt2", pipe, opt, extra=out["p2_extra"])
            p2 = pipe
        losses = []
        for step in range(SAVED_AT, SAVED_AT + MORE):
            losses.append(pipe.train_step(*batch(step)))
            opt.step()
            opt.zero_grad()
        out[f"{label}_losses"] = losses
    gpipe = pipe  # the pure-DP GPT pipeline

    # BatchNorm statistics: saved under original names, from replica 0 (replica 1's differ on purpose)
    model = resnet()
    names = trace_layers(model).names
    pipe = dapple.pipeline(model, plan_for(model, [((0, 3), [0, 1]), ((3, len(names)), [2])]),
                           nn.functional.cross_entropy, timeout=30)
    fill_buffers(model, 1000.0 * pipe.replica)
    dapple.save_checkpoint(f"{root}/resnet", pipe)

    # errors: every rank raises (with the agreement step nobody hangs), naming the problem
    errors = {}
    errors["missing"] = _error(lambda: dapple.load_checkpoint(f"{root}/nope", pipe))
    errors["not_dapple"] = _error(lambda: dapple.load_checkpoint(f"{root}/junk", pipe))
    errors["plain_dcp"] = _error(lambda: dapple.load_checkpoint(f"{root}/plain_dcp", pipe))
    errors["gpt_into_resnet"] = _error(lambda: dapple.load_checkpoint(f"{root}/ckpt1", pipe))
    errors["save_over_junk"] = _error(lambda: dapple.save_checkpoint(f"{root}/junk", pipe))
    wide = gpt(n_embd=12)
    wpipe = dapple.pipeline(wide, plan_for(wide, P2), lm_loss, timeout=30)
    errors["wider"] = _error(lambda: dapple.load_checkpoint(f"{root}/ckpt1", wpipe))
    longer = gpt(block_size=12)  # only wpe (stage 0: ranks 0, 1) differs
    lpipe = dapple.pipeline(longer, plan_for(longer, P2), lm_loss, timeout=30)
    errors["longer"] = _error(lambda: dapple.load_checkpoint(f"{root}/ckpt1", lpipe))
    errors["sgd"] = _error(lambda: dapple.load_checkpoint(f"{root}/ckpt1", gpipe, torch.optim.SGD(
        gpipe.parameters(), lr=0.1)))
    errors["no_opt_state"] = _error(lambda: dapple.load_checkpoint(f"{root}/resnet", pipe, torch.optim.SGD(
        pipe.parameters(), lr=0.1)))
    out["errors"] = errors
    out["damaged"] = damaged(root, gpipe)
    out["async"] = async_saves(root, p2)

    # a rank that never joins: the others fail within the pipeline's timeout instead of hanging; a load on a
    # pipeline whose group exists, and the first save of a fresh one, which creates it (`if rank == 0: save`)
    # (built with a long timeout, then 2 s: building connects NCCL's communicators, seconds on a busy GPU machine)
    model = gpt()
    tpipe = dapple.pipeline(model, plan_for(model, P3), lm_loss, timeout=30)
    tpipe.timeout = 2.0
    checkpoint_group(tpipe, "warm-up")  # made while all are present (it waits on the store)
    out["timeout"] = _without_rank_2(lambda: dapple.load_checkpoint(f"{root}/ckpt1", tpipe), "timeout")
    fresh = dapple.pipeline(model, plan_for(model, P3), lm_loss, timeout=30)
    fresh.timeout = 2.0
    out["first_save"] = _without_rank_2(lambda: dapple.save_checkpoint(f"{root}/never", fresh), "first_save")
    return pack(out)


def _state(pipe: dapple.Pipeline, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.detach().clone() for t in pipe.state_dict().values()] + \
        [v.clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def damaged(root: str, pipe: dapple.Pipeline) -> dict[str, Any]:
    """Loads of damaged checkpoints and a read and a write that fail on rank 1 only: what each rank raised, and
    whether any rank's parameters or optimizer state changed."""
    import torch.distributed.checkpoint as dcp_api
    opt = adamw(pipe.named_parameters())
    pipe.train_step(*batch(0))
    opt.step()  # some optimizer state, which must not change either
    before, out = _state(pipe, opt), {}
    for name in ("missing_shard", "truncated_shard"):
        out[name] = _error(lambda: dapple.load_checkpoint(f"{root}/{name}", pipe, opt))
    rank = int(os.environ["RANK"])
    read, write = dcp_api.FileSystemReader.read_data, dcp_api.FileSystemWriter.write_data

    calls = [0]

    def broken(*args, **kwargs):
        calls[0] += 1
        if calls[0] > 1:  # the first read is of the checkpoint's description, by this rank alone
            raise OSError(5, "Input/output error")
        return read(*args, **kwargs)
    if rank == 1:
        dcp_api.FileSystemReader.read_data = broken
        dcp_api.FileSystemWriter.write_data = broken
    out["read_fails"] = _error(lambda: dapple.load_checkpoint(f"{root}/ckpt1", pipe, opt))
    out["write_fails"] = _error(lambda: dapple.save_checkpoint(f"{root}/ckpt2", pipe, opt))
    dcp_api.FileSystemReader.read_data, dcp_api.FileSystemWriter.write_data = read, write
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _state(pipe, opt)))
    dapple.load_checkpoint(f"{root}/ckpt1", pipe, opt)  # and the pipeline goes on
    out["loss_after"] = pipe.train_step(*batch(SAVED_AT))
    return out


def async_saves(root: str, pipe: dapple.Pipeline) -> dict[str, Any]:
    """From ckpt1 on plan P2: a background save, two steps while it writes (they change every tensor it saved),
    its result, a load of it and the same two steps again; then a background write failing on rank 1, surfacing
    at the next save, which then goes on."""
    import torch.distributed.checkpoint as dcp_api
    opt, out = adamw(pipe.named_parameters()), {}
    dapple.save_checkpoint(f"{root}/fresh", pipe, opt)  # an optimizer never stepped: saving gives it no state
    out["fresh_state"] = len(opt.state)
    dapple.load_checkpoint(f"{root}/ckpt1", pipe, opt)
    out["at_save"] = snapshot(pipe.named_parameters(), opt)
    handle = dapple.save_checkpoint(f"{root}/async", pipe, opt, extra={"tag": torch.arange(3)}, async_save=True)
    out["losses"] = _steps(pipe, opt)
    handle.result()
    out["handle"] = repr(handle)
    out["extra"] = dapple.load_checkpoint(f"{root}/async", pipe, opt)
    out["step"], out["loaded"] = pipe.step, snapshot(pipe.named_parameters(), opt)
    out["losses_again"] = _steps(pipe, opt)
    write = dcp_api.FileSystemWriter.write_data

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")
    if int(os.environ["RANK"]) == 1:
        dcp_api.FileSystemWriter.write_data = broken  # (read when the background thread writes)
    failing = dapple.save_checkpoint(f"{root}/async", pipe, opt, async_save=True)
    _steps(pipe, opt)
    out["next_call"] = _error(lambda: dapple.load_checkpoint(f"{root}/async", pipe, opt))
    dcp_api.FileSystemWriter.write_data = write
    out["result_after"] = _error(failing.result)
    out["failed_handle"] = repr(failing)
    out["then"] = _error(lambda: dapple.load_checkpoint(f"{root}/async", pipe, opt))
    out["step_then"] = pipe.step
    return out


def _steps(pipe: dapple.Pipeline, opt: torch.optim.Optimizer) -> list[float]:
    losses = []
    for step in range(SAVED_AT, SAVED_AT + MORE):
        losses.append(pipe.train_step(*batch(step)))
        opt.step()
        opt.zero_grad()
    return losses


# ---- the tests ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ckpt")
    (root / "junk").mkdir()
    (root / "junk" / "notes.txt").write_text("not a checkpoint")
    with pytest.warns(UserWarning):  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"x": torch.ones(2)}, checkpoint_id=root / "plain_dcp")  # no group here: no_dist implied
    saved = [unpack(b) for b in run_ranks(train_and_save, 2, str(root), timeout=120)]
    shards = sorted((root / "ckpt1").glob("*.distcp"))
    assert [f.name for f in shards] == ["__0_0.distcp", "__1_0.distcp"]  # one per rank that saved
    for name, (shard, damage) in {"missing_shard": (1, lambda f: f.unlink()),
                                  "truncated_shard": (0, lambda f: os.truncate(f, f.stat().st_size // 2))}.items():
        shutil.copytree(root / "ckpt1", root / name)
        damage(root / name / shards[shard].name)
    resumed = [unpack(b) for b in run_ranks(resume, 3, str(root), timeout=120)]
    return {"root": root, "saved": saved, "resumed": resumed}


@pytest.fixture(scope="module")
def reference() -> dict:
    """Uninterrupted single-process training: losses of all 5 steps, state after step 3."""
    model = gpt()
    opt = adamw(model.named_parameters())
    losses, at_save = [], None
    for step in range(SAVED_AT + MORE):
        loss = lm_loss(model(batch(step)[0]), batch(step)[1])
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
        if step == SAVED_AT - 1:
            at_save = {k: v.clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "state_dict": at_save}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.slow
def test_resume_under_other_plans_and_world_size(run, reference):
    saved = {}
    for r in run["saved"]:  # world 2, plan P1; the tied weight is on both ranks, equal
        for n, p in r["params"].items():
            assert n not in saved or torch.equal(saved[n][0], p)
            saved[n] = (p, r["state"][n], r["hyper"][n])
        errs = [_rel(a, b) for a, b in zip(r["losses"], reference["losses"])]
        assert len(errs) == SAVED_AT and all(e <= TOL for e in errs), errs  # all(): a NaN fails, unlike max()
    assert set(saved) == {n for n, _ in gpt().named_parameters()}
    for label in ("p2", "p3"):
        seen = set()
        for rank, r in enumerate(run["resumed"]):
            assert r[f"{label}_step"] == SAVED_AT and r[f"{label}_extra"]["data_step"] == SAVED_AT
            assert torch.equal(r[f"{label}_extra"]["tag"], torch.arange(3))
            got = r[f"{label}_loaded"]
            for n, p in got["params"].items():
                want_p, want_state, want_hyper = saved[n]
                assert torch.equal(p, want_p), (label, rank, n)
                assert set(got["state"][n]) == {"step", "exp_avg", "exp_avg_sq"}, (label, rank, n)
                for k, v in got["state"][n].items():
                    assert torch.equal(v, want_state[k]), (label, rank, n, k)
                assert got["hyper"][n] == want_hyper == (1e-2, 0.1 if p.dim() >= 2 else 0.0), (label, n)
            seen |= set(got["params"])
            # continuing gives the losses of uninterrupted training (single process, same data)
            errs = [_rel(a, b) for a, b in zip(r[f"{label}_losses"], reference["losses"][SAVED_AT:])]
            assert len(errs) == MORE and all(e <= TOL for e in errs), (label, rank, errs)
        assert seen == set(saved), label


@pytest.mark.slow
def test_full_state_dict_is_the_models(run, reference):
    root = run["root"]
    full = dapple.load_full_state_dict(root / "ckpt1")
    ref = reference["state_dict"]
    assert list(full) == list(ref)  # every name, in the model's order; the tied weight under both names
    assert full["wte.weight"] is full["lm_head.weight"]
    for k, v in ref.items():
        assert full[k].dtype == v.dtype and full[k].shape == v.shape, k
        assert (full[k] - v).abs().max() <= TOL * v.abs().max(), k
    fresh = gpt(n_embd=8)
    fresh.load_state_dict(full, strict=True)
    assert torch.equal(fresh.wte.weight, full["wte.weight"]) and fresh.lm_head.weight is fresh.wte.weight
    # re-saved from another plan and world size (3 ranks, replicated stage): the same model
    again = dapple.load_full_state_dict(root / "ckpt2")
    assert list(again) == list(full) and all(torch.equal(again[k], full[k]) for k in full)
    # BatchNorm statistics under their original names, from replica 0 of the replicated stage
    model = resnet()
    fill_buffers(model, 0.0)
    bn = dapple.load_full_state_dict(root / "resnet")
    assert set(bn) == set(model.state_dict())
    assert any(k.endswith("running_mean") for k in bn) and any(k.endswith("num_batches_tracked") for k in bn)
    for k, v in model.state_dict().items():
        assert torch.equal(bn[k], v), k
    resnet().load_state_dict(bn, strict=True)


def _stored_bytes(path: Path) -> tuple[int, int, int]:
    """(bytes in the data files, bytes the metadata points at, data files with something in them)."""
    md = dcp.FileSystemReader(path).read_metadata()
    files = [f for f in path.iterdir() if f.suffix == ".distcp"]
    referenced = sum(info.length for info in md.storage_data.values())
    return sum(f.stat().st_size for f in files), referenced, sum(1 for f in files if f.stat().st_size)


@pytest.mark.slow
def test_copies_are_written_once(run):
    root = run["root"]
    for name in ("ckpt1", "ckpt2", "resnet"):
        on_disk, referenced, nonempty = _stored_bytes(root / name)
        assert on_disk == referenced, name  # no replica's or tied stage's second copy anywhere
    # ckpt2 came from 3 ranks where ranks 0, 1 hold stage 0 and all three hold the tied weight: without
    # dedup those copies would be on disk 2-3 times; the unique payload is what ckpt1 (2 ranks) holds too
    assert _stored_bytes(root / "ckpt2")[0] == pytest.approx(_stored_bytes(root / "ckpt1")[0], rel=0.05)
    assert _stored_bytes(root / "ckpt2")[2] >= 2  # and the writes were spread over ranks
    assert not [p for p in root.iterdir() if p.name.endswith((".saving", ".replaced"))]


@pytest.mark.slow
def test_errors_are_clear_and_on_every_rank(run):
    per_rank = [r["errors"] for r in run["resumed"]]
    for rank, e in enumerate(per_rank):
        assert e["missing"].startswith("FileNotFoundError") and "/nope" in e["missing"], e["missing"]
        assert e["not_dapple"].startswith("ValueError") and "not a dapple checkpoint" in e["not_dapple"]
        assert "not a dapple one" in e["plain_dcp"] and "'x'" in e["plain_dcp"], e["plain_dcp"]
        needs = "'layers.0.conv1.weight'" if rank == 2 else "'stem.0.weight'"  # what this stage needs, what it holds
        assert "the checkpoint lacks" in e["gpt_into_resnet"] and needs in e["gpt_into_resnet"] \
            and "'wte.weight'" in e["gpt_into_resnet"], e["gpt_into_resnet"]
        junk = e["save_over_junk"]  # rank 0 checks the target; the others raise with its first line
        assert "/junk holds files but is not a dapple checkpoint; refusing to replace" in junk, junk
        assert (rank == 0) == junk.startswith("ValueError") and (rank == 0) != ("rank 0 (stage 0) failed" in junk), junk
        assert "shape mismatch" in e["wider"] and "(32, 12)" in e["wider"] and "(32, 8)" in e["wider"], e["wider"]
        assert "/resnet" in e["no_opt_state"] and "saved without optimizer state" in e["no_opt_state"], \
            e["no_opt_state"]
        assert "is for torch.optim.adamw.AdamW, the optimizer given is torch.optim.sgd.SGD" in e["sgd"], e["sgd"]
    # only ranks 0, 1 (stage 0) hold wpe; rank 2 raises too, naming rank 0's problem
    for rank in (0, 1):
        assert "wpe.weight: checkpoint (16, 8), this model (12, 8)" in per_rank[rank]["longer"]
    assert per_rank[2]["longer"].startswith("PipelineError") and "rank 0 (stage 0) failed" in per_rank[2]["longer"]
    assert "wpe.weight" in per_rank[2]["longer"]
    assert (Path(run["root"]) / "junk" / "notes.txt").exists()  # refused, not replaced
    for rank in (0, 1):
        seconds, msg = run["resumed"][rank]["timeout"]
        assert msg.startswith(f"PipelineError: rank {rank} (stage 0), load_checkpoint(") and "exchanging with every " \
            "rank failed or timed out (timeout 2s)" in msg, msg
        assert "not every rank came to it: rank 2 (stage 0) is at 'warm-up: creating the gloo group" in msg, msg
        assert seconds < STALL_LIMIT, (seconds, msg)  # the timeout ended it, not rank 2's return
        seconds, msg = run["resumed"][rank]["first_save"]
        assert msg.startswith(f"PipelineError: rank {rank} (stage 0), save_checkpoint(") and "/never'): creating " \
            "the gloo group of every rank (did every rank call it?) failed or timed out (timeout 2s)" in msg, msg
        assert "rank 2 (stage 0) is at" in msg, msg  # the rank that did not come, named
        assert seconds < STALL_LIMIT, (seconds, msg)


@pytest.mark.slow
def test_a_damaged_checkpoint_or_a_failed_read_changes_no_rank(run, reference):
    """A missing or truncated shard is found before anything is read (the ranks that read it name the file, the
    others name that rank); a read or write failing on one rank makes every rank raise, naming it. No rank's
    parameters or optimizer state changed, and the pipeline goes on."""
    for rank, r in enumerate(run["resumed"]):
        d = r["damaged"]
        for name, file in (("missing_shard", "__1_0.distcp is missing"), ("truncated_shard", "__0_0.distcp has ")):
            msg = d[name]
            assert file in msg and "damaged checkpoint" in msg and "nothing was loaded" in msg, (rank, msg)
            assert msg.startswith(f"ValueError: rank {rank} (stage") or re.match(
                rf"PipelineError: rank {rank} \(stage \d\), load_checkpoint\(.*\) stopped because rank \d "
                rf"\(stage \d\) failed: ValueError: rank \d \(stage \d\): damaged checkpoint", msg), (rank, msg)
        assert d["read_fails"].startswith(f"RuntimeError: rank {rank} (stage 0): load_checkpoint("), d
        assert d["read_fails"].endswith("): reading failed: on rank 1: OSError: [Errno 5] Input/output error"), d
        assert d["write_fails"].startswith(f"RuntimeError: rank {rank} (stage 0): save_checkpoint("), d
        assert d["write_fails"].endswith("): writing failed: on rank 1: OSError: [Errno 5] Input/output error"), d
        assert d["unchanged"], rank
        assert _rel(d["loss_after"], reference["losses"][SAVED_AT]) <= TOL, rank
    assert dapple.load_full_state_dict(run["root"] / "ckpt2").keys()  # the failed write left the last save intact


def test_full_state_dict_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*missing"):
        dapple.load_full_state_dict(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty is not a dapple checkpoint"):
        dapple.load_full_state_dict(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="file is not a dapple checkpoint: it is a file"):
        dapple.load_full_state_dict(tmp_path / "file")


@pytest.mark.slow
def test_description_of_the_checkpoint(run):
    """Plan, step, versions, optimizer class and groups, extra: what a resume or a person needs to know."""
    from dapple.runtime.checkpoint import _read_meta
    _, meta = _read_meta(run["root"] / "ckpt1")
    model = gpt()
    assert meta["plan"] == plan_for(model, P1).to_dict() and meta["world_size"] == 2 and meta["step"] == SAVED_AT
    assert meta["torch_version"] == str(torch.__version__) and meta["dapple_version"] == dapple.__version__
    assert meta["extra"]["data_step"] == SAVED_AT
    opt = meta["optimizer"]
    assert opt["class"] == "torch.optim.adamw.AdamW"
    by_name = {n: g["hyper"] for g in opt["param_groups"] for n in g["params"]}
    assert set(by_name) == {n for n, _ in model.named_parameters()}  # keyed by name, not optimizer index
    for n, p in model.named_parameters():
        assert by_name[n]["lr"] == 1e-2 and by_name[n]["weight_decay"] == (0.1 if p.dim() >= 2 else 0.0), n
        assert set(opt["state"][n]) == {"step", "exp_avg", "exp_avg_sq"}, n
    assert meta["tensors"]["wte.weight"]["names"] == ["wte.weight", "lm_head.weight"]


@pytest.mark.slow
def test_an_async_save_holds_what_it_was_given_and_a_failure_surfaces_at_the_next_call(run, reference):
    """Training on while the background write runs changes nothing it saved: the load gives the state of the save
    and the same losses again, to the bit. A write failing on rank 1 is raised on every rank by the next checkpoint
    call (and by the handle's result()), and the checkpoint before it stays in place."""
    for rank, r in enumerate(run["resumed"]):
        a = r["async"]
        assert a["fresh_state"] == 0, rank
        assert a["step"] == SAVED_AT and torch.equal(a["extra"]["tag"], torch.arange(3)), rank
        got, want = a["loaded"], a["at_save"]
        for n, p in want["params"].items():
            assert torch.equal(got["params"][n], p), (rank, n)
            assert all(torch.equal(got["state"][n][k], v) for k, v in want["state"][n].items()), (rank, n)
        assert got["hyper"] == want["hyper"], rank
        assert a["losses_again"] == a["losses"], rank
        assert all(_rel(x, y) <= TOL for x, y in zip(a["losses"], reference["losses"][SAVED_AT:])), rank
        assert "in place" in a["handle"] and "failed" in a["failed_handle"], (a["handle"], a["failed_handle"])
        msg = a["next_call"]
        assert msg.startswith(f"RuntimeError: rank {rank} (stage {rank // 2}): save_checkpoint(") and msg.endswith(
            "/async'): writing failed: on rank 1: OSError: [Errno 28] No space left on device"), msg
        assert a["result_after"] == msg, rank  # the handle says the same
        assert a["then"] == "no error" and a["step_then"] == SAVED_AT, (rank, a["then"])  # and the last one loads
    root = run["root"]
    assert not (root / "async.saving").exists()
    full = dapple.load_full_state_dict(root / "async")
    want = run["resumed"][0]["async"]["at_save"]["params"]
    assert all(torch.equal(full[n], p) for n, p in want.items())
