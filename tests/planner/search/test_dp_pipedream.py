"""The planner on the paper's measured profiles, config A (2 servers x 8 V100): Table VII's plans."""

from __future__ import annotations

import dataclasses

import pytest

import dapple
from dapple import Cluster, Plan
from dapple.planner import Stage, simulate
from tests.conftest import pipedream_profile


@pytest.mark.parametrize("name, global_batch", [("xlnet_36", 128), ("bert_48", 64), ("amoebanet_36", 128)])
def test_uniform_models_get_one_stage_per_server(name, global_batch):
    """Table VII: two stages of 8 devices, each on its own server (activations cross the slow link once, each
    stage's AllReduce stays on NVLink); the split lands near the paper's (22:19, 13:13 of 26, 30:13)."""
    prof = pipedream_profile(name)
    A = Cluster.preset("A")
    plan = dapple.plan(prof, A, global_batch, overlap=False)  # (the paper's assumption: with overlap, xlnet_36 is DP)
    assert [sorted(s.devices) for s in plan.stages] == [list(range(8)), list(range(8, 16))]
    cut = plan.stages[0].layers[1]
    assert 0.4 * prof.num_layers < cut < 0.75 * prof.num_layers
    sim = simulate(plan, prof, A).latency_ms
    assert plan.estimate.latency_ms == pytest.approx(sim, rel=0.05)
    pure_dp = dapple.plan(prof, A, global_batch, max_stages=1, overlap=False)  # micro-batch searched (>= 16 rows)
    assert sim < simulate(pure_dp, prof, A).latency_ms  # and the pipeline beats data parallelism


def test_vgg19_keeps_the_fully_connected_tail_off_the_replicated_stage():
    """Table VII prints 14:2 with the conv5 block and the FC layers on 2 devices. Under this cost model the DP
    finds 11:4:1 (FC layers on one device, no AllReduce of FC1's 392 MB), which the simulator finds faster
    than the paper's plan and than data parallelism; see the report for why the split differs."""
    prof = pipedream_profile("vgg19")
    A = Cluster.preset("A")
    plan = dapple.plan(prof, A, 1024)
    fc1 = prof.layer_names.index("node23:FC1")
    tail = plan.stages[plan.stage_of_device(15)]
    assert tail.layers[0] <= fc1 and tail.layers[1] == prof.num_layers
    assert len(tail.devices) <= 2 and len({d // 8 for d in tail.devices}) == 1
    assert len(plan.stages[0].devices) >= 11  # the convolutions are replicated widely
    ours = simulate(plan, prof, A).latency_ms
    b = plan.micro_batch_size
    paper = Plan(1024, b, [Stage((0, 17), list(range(14))), Stage((17, 26), [14, 15])], warmup_policy="B")
    assert ours < simulate(paper, prof, A).latency_ms
    assert ours < simulate(dapple.plan(prof, A, 1024, b, max_stages=1), prof, A).latency_ms


@pytest.mark.parametrize("scale", [1.29, 1.43, 1.57])
def test_vgg19_with_the_tail_holding_its_share_of_devices_beats_the_papers_14_2(scale):
    """PipeDream's vgg19 profile gives layers [17, 26) (conv5_1 .. loss) 9.3% of the work where Table VII's 14:2
    gives them 2 of 16 devices. Scaled to 1.43x their compute (their 2/16 share, benchmarks/vgg19_table7.py
    --tail-scale), and 10% either side, dapple's plan (the default: AllReduce overlapped) simulates more than 3%
    faster than the paper's 14:2 at every micro-batch size and warmup policy (by 5.9% to 11.1% when written; which
    plan wins, 14:2 at another cut or 11:4:1, changes within the range, so only the margin is asserted)."""
    prof = pipedream_profile("vgg19")
    prof = dataclasses.replace(prof, layers=[
        dataclasses.replace(lay, forward_ms=[scale * t for t in lay.forward_ms],
                            backward_ms=[scale * t for t in lay.backward_ms]) if i >= 17 else lay
        for i, lay in enumerate(prof.layers)])
    A = Cluster.preset("A")
    plan = dapple.plan(prof, A, 1024)
    ours = simulate(plan, prof, A).latency_ms
    for b in (16, 32, 64, 128, 256):
        for policy in ("A", "B"):
            paper = Plan(1024, b, [Stage((0, 17), list(range(14))), Stage((17, 26), [14, 15])], warmup_policy=policy)
            assert simulate(paper, prof, A, overlap=True).latency_ms > 1.03 * ours, (b, policy, plan)


@pytest.mark.parametrize("name, global_batch, config, replicas", [
    ("resnet50", 2048, "A", [16]), ("resnet50", 2048, "B", [16]), ("resnet50", 2048, "C", [16]),
    ("vgg19", 2048, "A", [16]), ("vgg19", 2048, "B", [16]), ("vgg19", 2048, "C", [15, 1])])
def test_overlapped_allreduce_makes_data_parallelism_win_as_in_table_v(name, global_batch, config, replicas):
    """Table V (global batch 2048): ResNet-50 is data parallel on A, B and C; VGG-19 too on A and B, and 15:1
    on C, where replicating its 400 MB FC tail costs more than overlap hides. The runtime overlaps gradient
    AllReduce with the last backward (DDP-style buckets), and with ``overlap=True`` the planner models that:
    without it these plans are pipelines (resnet50 on C: 13:3, 19% slower under the overlapped simulator)."""
    prof = pipedream_profile(name)
    cluster = Cluster.preset(config)
    plan = dapple.plan(prof, cluster, global_batch, overlap=True)
    assert [len(s.devices) for s in plan.stages] == replicas
    if replicas == [15, 1]:  # the split lands between the convolutions and the FC layers (paper V-B)
        assert plan.stages[1].layers[0] == prof.layer_names.index("node23:FC1")
