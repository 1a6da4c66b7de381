"""Run by torchrun as one of two nodes on this machine: a plan for 2 servers x 2 devices whose middle stage is
replicated across the servers; rank 0 writes the step's errors against single-process training (JSON)."""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dapple
from dapple.planner import Plan, Stage
from dapple.profiler import trace_layers
from tests.runtime.workers import Chain, _chain_data, _compare, _reference


def main(out: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Chain().double()
    cluster = dapple.Cluster(servers=2, devices_per_server=2, intra_bandwidth=1e9, inter_bandwidth=1e8)
    # ranks 0, 1 on server 0 and 2, 3 on server 1: stage 1 has a replica on each
    plan = Plan(global_batch_size=8, micro_batch_size=4, layer_names=trace_layers(model).names,
                stages=[Stage((0, 2), [0]), Stage((2, 4), [1, 2]), Stage((4, 5), [3])],
                meta={"cluster_spec": cluster.to_dict()})
    pipe = dapple.pipeline(model, plan, F.cross_entropy, timeout=60)
    x, y = _chain_data(8)
    ref_loss, ref = _reference(copy.deepcopy(model), F.cross_entropy, x, y)
    res = _compare(pipe, pipe.train_step(x, y), ref_loss, ref)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, res)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
