"""dapple/runtime/batchnorm.py: deferred BatchNorm statistics equal single-device training on the global batch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dapple
from dapple.planner import Plan, Stage
from dapple.profiler import trace_layers
from dapple.runtime.batchnorm import DeferredBatchNorm, commit, defer_batch_norms, gather_sums
from tests.conftest import EXPORT_OK
from tests.runtime._spawn import run_ranks


class ConvBN(nn.Module):
    """x (B, 2, 4, 4) -> a conv branch with BatchNorm2d (momentum 0.1) and a Linear branch with BatchNorm1d
    (cumulative: momentum None), side by side: each BatchNorm sees rows no other BatchNorm normalised, so its
    statistics can equal single-device training's exactly (in series, the second would see the first's
    per-slice normalisation, which micro-batches change). Layers: conv bn2 proj fc bn1 head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)
        self.proj = nn.Linear(64, 8)
        self.fc = nn.Linear(32, 8)
        self.bn1 = nn.BatchNorm1d(8, momentum=None)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.proj(torch.relu(self.bn2(self.conv(x))).flatten(1))  # (B, 8)
        b = torch.tanh(self.bn1(self.fc(x.flatten(1))))  # (B, 8)
        return self.head(torch.cat([a, b], 1))


def _model() -> ConvBN:
    torch.manual_seed(0)
    return ConvBN().double()


def _batches(steps: int, gbs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(gbs, 2, 4, 4, generator=g, dtype=torch.float64) * 3 + 1,
             torch.randint(0, 3, (gbs,), generator=g)) for _ in range(steps)]


def _arrays(named) -> dict:
    """name -> numpy copy (tensors through the result queue would need the process alive to share them)."""
    return {n: t.detach().cpu().numpy().copy() for n, t in named}


def _worker(stages: list, gbs: int, mbs: int, steps: int) -> dict:
    """Two pipelines over copies of one model, deferred and not, on the same batches: their losses, gradients
    and (per step) BatchNorm buffers, and the buffers of single-device training on each global batch."""
    torch.set_default_dtype(torch.float64)
    base = _model()
    names = trace_layers(base).names
    plan = Plan(gbs, mbs, [Stage(*s) for s in stages], layer_names=names)
    ref, out = copy.deepcopy(base), {}
    for deferred in (True, False):
        model = copy.deepcopy(base)
        pipe = dapple.pipeline(model, plan, F.cross_entropy, timeout=60, deferred_batch_norm=deferred)
        got = []
        for x, y in _batches(steps, gbs):
            loss = pipe.train_step(x, y)
            got.append((loss, _arrays((n, p.grad) for n, p in pipe.named_parameters()),
                        _arrays(pipe.module.named_buffers())))
            for p in pipe.parameters():
                p.grad = None
        out[deferred] = got
    ref.train()
    with torch.no_grad():
        out["ref"] = [_arrays(ref.named_buffers()) for x, _ in _batches(steps, gbs) if ref(x) is not None]
    return out


# (layers, devices): conv+bn2 on two replicas, the rest on one; and the reverse
SHAPES = {"replicated_first": ([((0, 2), [0, 1]), ((2, 6), [2])], 12, 6),  # conv bn2 | proj fc bn1 head
          "replicated_last": ([((0, 3), [0]), ((3, 6), [1, 2])], 12, 4)}  # conv bn2 proj | fc bn1 head


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SHAPES))
def test_deferred_statistics_equal_single_device_training_on_the_global_batch(shape):
    stages, gbs, mbs = SHAPES[shape]
    for rank, r in enumerate(run_ranks(_worker, 3, stages, gbs, mbs, 2)):  # numpy arrays, by name
        ref = r["ref"]
        for step in range(2):
            loss, grads, bufs = r[True][step]
            loss_plain, grads_plain, bufs_plain = r[False][step]
            # the forward is BatchNorm's own: same loss and gradients as the pipeline without deferral
            assert loss == pytest.approx(loss_plain, rel=1e-12, abs=1e-12)
            for n, g in grads.items():
                np.testing.assert_allclose(g, grads_plain[n], rtol=1e-12, atol=1e-12)
            for n, b in bufs.items():  # running mean, var and count of the whole global batch, every replica
                assert b.dtype == ref[step][n].dtype, (rank, step, n)
                np.testing.assert_allclose(b, ref[step][n], rtol=1e-10, atol=1e-12,
                                           err_msg=f"rank {rank} step {step} {n}")
        # the control: without deferral the statistics are the slices' of each micro-batch, not the batch's
        assert any("running" in n and not np.allclose(b, ref[1][n]) for n, b in r[False][1][2].items()), rank


def test_deferred_batchnorm_shares_the_tensors_and_names_of_the_layer_it_replaces():
    m = _model()
    before = {n: t for n, t in m.state_dict(keep_vars=True).items()}
    bns = defer_batch_norms(m)
    assert [type(b) for b in bns] == [DeferredBatchNorm, DeferredBatchNorm]
    after = m.state_dict(keep_vars=True)
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)
    with pytest.raises(ValueError, match="expected 2D or 3D input"):  # BatchNorm1d's own input check
        m.bn1(torch.zeros(2, 8, 1, 1, dtype=torch.float64))


def test_one_replica_commits_the_statistics_of_all_its_micro_batches():
    m, ref = _model(), _model()
    bns = defer_batch_norms(m)
    x = torch.randn(8, 2, 4, 4, dtype=torch.float64)
    for part in x.split(3):  # 3 + 3 + 2 rows, as micro-batches
        m(part)
    assert m.bn2.num_batches_tracked.item() == 0  # nothing committed before the end of the step
    commit(bns, gather_sums(bns, "test"))
    ref(x)
    for n, b in ref.named_buffers():
        torch.testing.assert_close(dict(m.named_buffers())[n], b, rtol=1e-12, atol=1e-12)


def _export_worker() -> str:
    model = _model()
    model.bn1.momentum = 0.1  # export cannot trace momentum=None's float(num_batches_tracked)
    x = torch.randn(4, 2, 4, 4, dtype=torch.float64)
    names = trace_layers(model, tracer="export", example_inputs=(x,)).names
    plan = Plan(4, 4, [Stage((0, len(names)), [0])], layer_names=names)
    with pytest.raises(ValueError, match="tracer='fx'") as e:
        dapple.pipeline(model, plan, F.cross_entropy, tracer="export", example_inputs=(x,), deferred_batch_norm=True)
    return str(e.value)


@pytest.mark.skipif(not EXPORT_OK, reason="tracer='export' needs torch >= 2.9")
def test_deferred_batchnorm_with_an_exported_graph_is_refused_by_name():
    assert "BatchNorm" in run_ranks(_export_worker, 1)[0]


def test_deferred_batch_norm_must_be_a_bool():
    model = _model()
    plan = Plan(4, 4, [Stage((0, 6), [0])], layer_names=trace_layers(model).names)
    with pytest.raises(TypeError, match="deferred_batch_norm: expected True or False, got 'yes'"):
        dapple.pipeline(model, plan, F.cross_entropy, deferred_batch_norm="yes")  # before any process group
