"""Bad input fails before any work, naming the values: plan vs world, layer names, batch sizes, arguments."""

from __future__ import annotations

import copy
import re
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dapple
from dapple.planner import Plan, Stage
from tests.profiler.test_layers import Masked
from tests.runtime.workers import Chain, _chain_data, _plan


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    """dapple.pipeline initialises a one-process world itself when not launched by torchrun."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_plan_needs_more_ranks_than_the_world_has():
    model = Chain()
    plan = _plan(model, [((0, 2), [0]), ((2, 5), [1])], 8, 2)
    with pytest.raises(ValueError, match=r"plan needs 2 ranks, world has 1"):
        dapple.pipeline(model, plan, F.cross_entropy)


def test_layer_names_differ_at_an_index():
    model = Chain()
    names = ["blocks.0", "blocks.1", "blocks.9", "blocks.3", "head"]
    plan = Plan(global_batch_size=8, micro_batch_size=2, stages=[Stage((0, 5), [0])], layer_names=names)
    with pytest.raises(ValueError, match=r"at index 2: the plan has 'blocks.9', the model has 'blocks.2'"):
        dapple.pipeline(model, plan, F.cross_entropy)
    short = Plan(global_batch_size=8, micro_batch_size=2, stages=[Stage((0, 4), [0])])
    with pytest.raises(ValueError, match=r"plan covers 4 layers but the model has 5"):
        dapple.pipeline(model, short, F.cross_entropy)


def test_bad_arguments():
    model = Chain()
    plan = _plan(model, [((0, 5), [0])], 8, 2)
    with pytest.raises(TypeError, match="loss_fn: expected a callable .* got 'cross_entropy'"):
        dapple.pipeline(model, plan, "cross_entropy")
    for bad in (0, 0.0004, float("inf"), float("nan"), True, "60"):  # 0.4 ms rounds to 0 ms: no bound at all
        with pytest.raises(ValueError, match=rf"timeout: expected a finite number of seconds >= 0.001 .* got "
                                             rf"{re.escape(repr(bad))}"):
            dapple.pipeline(model, plan, F.cross_entropy, timeout=bad)
    with pytest.raises(ValueError, match="backend: expected 'nccl', 'gloo' or None .* got 'NCCL2'"):
        dapple.pipeline(model, plan, F.cross_entropy, backend="NCCL2")
    dapple.pipeline(model, plan, F.cross_entropy)  # the world of one, on gloo here: a group exists from now on
    if dist.get_backend() == "gloo":
        with pytest.raises(ValueError, match="backend: got 'nccl', but the default process group already runs 'gloo'"):
            dapple.pipeline(model, plan, F.cross_entropy, backend="nccl")
    with pytest.raises(TypeError, match=r"plan: expected a dapple.Plan .* got dict"):
        dapple.pipeline(model, {"stages": []}, F.cross_entropy)


def test_batch_sizes_are_checked_with_values():
    model = Chain().double()
    pipe = dapple.pipeline(model, _plan(model, [((0, 5), [0])], 8, 2), F.cross_entropy)
    x, y = _chain_data(8)
    with pytest.raises(ValueError, match=r"inputs\[0\] has shape \(7, 6\); expected the global batch of 8 rows"):
        pipe.train_step(x[:7], y)
    with pytest.raises(ValueError, match=r"targets\[0\] has shape \(6,\); expected the global batch of 8 rows"):
        pipe.train_step(x, y[:6])
    with pytest.raises(ValueError, match=r"the model takes 1 inputs \['x'\], got 2"):
        pipe.train_step((x, x), y)
    assert pipe.global_step == pipe.step == 0  # nothing ran (step: the alias)


class Optional(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)

    def forward(self, x, scale=1.0, flag=False):
        y = self.a(x)
        if flag:  # specialised away by concrete_args
            y = y * 2
        return self.b(y * scale)


def test_arguments_with_defaults_may_be_left_out():
    model = Optional().double()
    plan = Plan(global_batch_size=8, micro_batch_size=4, stages=[Stage((0, 2), [0])], layer_names=["a", "b"])
    ref = copy.deepcopy(model)  # the pipeline moves ``model``'s layers to its device (on a GPU machine: cuda)
    pipe = dapple.pipeline(model, plan, F.cross_entropy, concrete_args={"flag": False})
    x, y = _chain_data(8)
    assert pipe.train_step(x, y) == pytest.approx(float(F.cross_entropy(ref(x), y).detach()), rel=1e-12)
    scale = torch.full((8, 6), 0.5, dtype=torch.float64)
    assert pipe.train_step((x, scale), y) == pytest.approx(float(F.cross_entropy(ref(x, scale), y).detach()),
                                                           rel=1e-12)
    with pytest.raises(ValueError, match=r"the model takes 1 to 3 inputs \['x', 'scale', 'flag_1'\], got 4"):
        pipe.train_step((x, x, x, x), y)


def test_a_mask_traced_as_a_tensor_must_be_passed_or_traced_as_none():
    """forward(x, mask=None): fx traces the mask branch, so train_step(x) would run it with None."""
    model = Masked().double()
    plan = Plan(global_batch_size=8, micro_batch_size=4, stages=[Stage((0, 2), [0])], layer_names=["a", "b"])
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 2, (8,))
    ref = copy.deepcopy(model)
    pipe = dapple.pipeline(model, plan, F.cross_entropy)
    with pytest.raises(ValueError, match=r"inputs: the model takes 2 to 3 inputs \['x', 'mask', 'scale'\], got 1; "
                                         r"\['mask'\] default to None .* concrete_args=\{'mask': None\}"):
        pipe.train_step(x, y)
    assert pipe.step == 0
    mask = torch.rand(8, 4, dtype=torch.float64)
    assert pipe.train_step((x, mask), y) == pytest.approx(float(F.cross_entropy(ref(x, mask), y).detach()), rel=1e-12)
    plain = dapple.pipeline(model, plan, F.cross_entropy, concrete_args={"mask": None})
    assert plain.train_step(x, y) == pytest.approx(float(F.cross_entropy(ref(x), y).detach()), rel=1e-12)


def test_single_rank_accumulates_micro_batches_exactly():
    """One rank, 4 micro-batches: the accumulated gradient is the whole-batch gradient (and the loss its mean)."""
    model = Chain().double()
    pipe = dapple.pipeline(model, _plan(model, [((0, 5), [0])], 8, 2), F.cross_entropy)
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in model.named_parameters()]
    x, y = _chain_data(8)
    ref = Chain().double()
    ref.load_state_dict(model.state_dict())
    loss = F.cross_entropy(ref(x), y)
    loss.backward()
    assert pipe.train_step(x, y) == pytest.approx(float(loss.detach()), rel=1e-12)
    for (n, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-12, atol=1e-15)


class Tripwire(torch.nn.Module):
    """Identity, but its call number ``bad_call`` (from 0) raises in the forward, or later in the backward.
    Traced as a leaf module, so it runs as Python in every micro-batch."""

    def __init__(self, bad_call: int, backward: bool):
        super().__init__()
        self.bad_call, self.backward, self.calls = bad_call, backward, 0

    def forward(self, h):
        self.calls += 1
        if self.calls - 1 == self.bad_call:
            if not self.backward:
                raise RuntimeError("boom in forward")
            h = h * 1.0
            h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom in backward")))
        return h


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (add_note) are Python 3.11+")
@pytest.mark.parametrize("backward", [False, True])
def test_an_error_in_the_model_is_noted_with_rank_stage_step_and_micro_batch(backward):
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), Tripwire(2, backward), torch.nn.Linear(6, 3)).double()
    plan = Plan(global_batch_size=8, micro_batch_size=2, stages=[Stage((0, 3), [0])], layer_names=["0", "1", "2"])
    pipe = dapple.pipeline(model, plan, F.cross_entropy, leaf_modules=[Tripwire])
    with pytest.raises(RuntimeError, match=f"boom in {'backward' if backward else 'forward'}") as err:
        pipe.train_step(*_chain_data(8))
    want = f"rank 0 (stage 0), step 1, micro-batch 2: in the {'backward' if backward else 'forward'} of layers [0, 3)"
    assert want in getattr(err.value, "__notes__", []), err.value


def test_a_failing_loss_fn_is_reported_with_where_and_what_it_was_given():
    model = Chain().double()
    x, y = _chain_data(8)

    def wrong(out, y):  # a loss that expects one-hot targets
        return F.binary_cross_entropy_with_logits(out, y)
    pipe = dapple.pipeline(model, _plan(model, [((0, 5), [0])], 8, 2), wrong)
    with pytest.raises(ValueError, match=r"must be the same as input size") as err:  # the loss's own error
        pipe.train_step(x, y)
    if sys.version_info >= (3, 11):  # add_note: where it happened and what loss_fn was given
        assert "rank 0 (stage 0), step 1, micro-batch 0: in loss_fn(output (2, 3), *targets [(2,)])" in \
            "\n".join(getattr(err.value, "__notes__", [])), err.value
    pipe = dapple.pipeline(model, _plan(model, [((0, 5), [0])], 8, 2), lambda out, y: out.sum(1))
    with pytest.raises(TypeError, match=r"rank 0 \(stage 0\), step 1, micro-batch 0: loss_fn must return a scalar"):
        pipe.train_step(x, y)


def test_a_plan_for_other_servers_than_the_job_has_is_named():
    """A plan made for 2 x 2 run with 4 ranks per node (or 1): correct, but not the placement it was made for."""
    from dapple.runtime.validate import layout_mismatch
    from tests.planner.helpers import cluster, linear_profile

    made = dapple.plan(linear_profile([1.0, 2.0, 1.0, 2.0], params=1e6, boundary=1e5), cluster(2, 2), 16)
    assert made.meta["cluster_spec"]["devices_per_server"] == 2
    assert layout_mismatch(made, 2) is None and layout_mismatch(made, None) is None
    for local in (1, 4):
        assert layout_mismatch(made, local) == (
            f"plan was made for servers of 2 devices (2 x 2, meta.cluster_spec) but this job runs {local} ranks per "
            f"node (LOCAL_WORLD_SIZE): its stages sit on other servers than planned and its estimate does not hold; "
            f"plan for devices_per_server={local}")
    one = dapple.plan(linear_profile([1.0, 2.0]), cluster(1, 2), 16)  # every rank on one server either way
    assert layout_mismatch(one, 4) is None
    assert layout_mismatch(Plan(16, 4, [Stage((0, 2), [0, 1])]), 4) is None  # no cluster recorded: nothing to say


def test_pipeline_warns_on_rank_0_that_the_placement_will_not_hold(monkeypatch):
    """The engine asks layout_mismatch with torchrun's LOCAL_WORLD_SIZE and warns what it says (a one-rank world
    here, so the answer is stood in for: one rank is on one server whatever the plan says)."""
    from dapple.runtime import engine

    asked = []
    monkeypatch.setattr(engine, "layout_mismatch", lambda plan, local: asked.append(local) or "made for 3 x 5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "7")
    model = Chain()
    with pytest.warns(UserWarning, match=r"^dapple.pipeline: made for 3 x 5$"):
        dapple.pipeline(model, _plan(model, [((0, 5), [0])], 8, 2), F.cross_entropy)
    assert asked == [7]
