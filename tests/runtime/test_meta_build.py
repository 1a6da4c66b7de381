"""A model built on the meta device (gloo, float64): each rank makes only its stage real, loads its weights with
load_weights from a sharded safetensors checkpoint (opening only its shards), a dapple checkpoint, a torch.save state
dict and a plain torch.distributed.checkpoint, and trains as the full build does (one process); tied weights across
stages; errors name the tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dapple
from dapple.models import lm_loss
from dapple.planner import Plan, Stage
from tests.runtime import meta_workers
from tests.runtime._spawn import run_ranks

TOL = 1e-12


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    paths = meta_workers.write_checkpoints(tmp_path_factory.mktemp("meta_build"))
    return run_ranks(meta_workers.run, 4, paths)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["safetensors", "dapple", "torch", "dcp"])
def test_meta_build_with_loaded_weights_trains_as_the_full_build(results, kind):
    for rank, r in enumerate(results):
        assert r[kind]["loss"] <= TOL and r[kind]["grads"] <= TOL, (kind, rank, r[kind])


@pytest.mark.slow
def test_each_rank_opens_only_its_stages_shards_and_reads_only_its_tensors(results):
    # stage 0: wte (also lm_head's weight) wpe blocks.0; stage 1: blocks.1-2; stage 2: blocks.3 ln_f lm_head, whose
    # weight the checkpoint stores once, as wte.weight (shard a)
    shards = [["a.safetensors", "b.safetensors"], ["b.safetensors", "c.safetensors"],
              ["b.safetensors", "c.safetensors"], ["a.safetensors", "d.safetensors"]]
    for rank, r in enumerate(results):
        got = r["safetensors"]
        assert got["files"] == shards[rank], (rank, got["files"])
        own = {k for k in r["own"] if k != "lm_head.weight"} | ({"wte.weight"} if rank in (0, 3) else set())
        assert sorted(got["keys"]) == sorted(own), rank  # each tensor once, none of another stage
        fmt, tensors, nbytes, unexpected = got["loaded"]
        assert (fmt, tensors, unexpected) == ("safetensors", len(own), [])
        assert nbytes == r["own_bytes"], rank  # the stage's own bytes (GPT has no persistent buffer)
    assert results[3]["safetensors"]["keys"].count("wte.weight") == 1  # the tied head, from the embedding's key


@pytest.mark.slow
def test_meta_build_makes_only_the_stage_real_and_replicas_start_equal(results):
    assert all(r["devices"] == ["cpu"] for r in results)
    assert results[1]["first"] == results[2]["first"]  # start_equal: the first replica's random init
    assert all(v == v for r in results for v in r["first"])  # initialised: no NaN sentinel left


@pytest.mark.slow
def test_load_weights_names_a_missing_key_and_a_wrong_shape(results):
    assert results[0]["bad"] is None  # stage 0's tensors are all there
    for rank in (1, 2):
        msg = results[rank]["bad"]
        assert "shapes differ" in msg and "'blocks.1.attn.qkv.weight': checkpoint (3, 3), model (24, 8)" in msg, msg
    assert "lacks 1 tensor" in results[3]["bad"] and "'ln_f.weight'" in results[3]["bad"], results[3]["bad"]


# ---- a stage nothing initialises ----------------------------------------------------------------------------
class Scale(nn.Module):
    """A parameter and a buffer computed in __init__, and no reset_parameters."""

    def __init__(self, d: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))
        self.register_buffer("table", torch.arange(d, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain + self.table


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.scale = nn.Linear(4, 4), Scale(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.fc(x))


def _init_cases() -> dict:
    """One rank: the default init leaves Scale unset (an error naming its tensors); an init_fn that sets it is
    called once per module holding a tensor, and the result equals the full build."""
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (out - y).pow(2).mean()

    plan = Plan(4, 2, [Stage((0, 2), [0])], layer_names=["fc", "scale"])
    with torch.device("meta"):
        model = Net()
    try:
        dapple.pipeline(model, plan, loss)
        error = None
    except ValueError as e:
        error = str(e)
    called = []

    def init(m: nn.Module) -> None:
        called.append(type(m).__name__)
        if isinstance(m, Scale):
            m.gain.fill_(1.0)
            m.table = torch.arange(4, dtype=torch.float32)  # assigned anew, on the CPU: moved to the stage
        elif isinstance(m, nn.Linear):
            m.reset_parameters()

    with torch.device("meta"):
        model = Net()
    pipe = dapple.pipeline(model, plan, loss, init_fn=init)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    full = Net()
    full.load_state_dict(pipe.state_dict())
    out = pipe.eval_step(x, x)
    return {"error": error, "called": called, "loss": (out, float(loss(full(x), x))),
            "table": pipe.module.get_buffer("scale.table").tolist()}


@pytest.mark.slow
def test_a_tensor_init_fn_leaves_unset_is_an_error_naming_it():
    r = run_ranks(_init_cases, 1)[0]
    assert r["error"] is not None and "'scale.gain'" in r["error"] and "'scale.table'" in r["error"], r["error"]
    assert "'fc.weight'" not in r["error"] and "init_fn" in r["error"]
    assert r["called"] == ["Linear", "Scale"]
    assert r["table"] == [0.0, 1.0, 2.0, 3.0] and abs(r["loss"][0] - r["loss"][1]) <= 1e-6


def test_init_fn_must_be_callable():
    with pytest.raises(TypeError, match="init_fn"):
        dapple.pipeline(nn.Linear(2, 2), Plan(2, 1, [Stage((0, 1), [0])]), lm_loss, init_fn="reset")
