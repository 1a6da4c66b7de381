"""Two servers on one machine: two torchrun nodes (c10d rendezvous on 127.0.0.1) train a plan whose stage is
replicated across them exactly as one process does, and `dapple probe` under the same launch sees 2 servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dapple import Cluster
from dapple.core.dist import free_port
from tests.conftest import ROOT

TOL = 1e-9


def _two_nodes(tmp_path, *command: str) -> None:
    """``command`` under ``torchrun --nnodes=2 --nproc_per_node=2``, both nodes started here; both must succeed."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={i}",
                               "--nproc_per_node=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                               "--rdzv_id=dapple-test", *command], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [n.communicate(timeout=240)[0] for n in nodes]
    for i, (n, out) in enumerate(zip(nodes, outs)):
        assert n.returncode == 0, f"node {i}:\n{out[-3000:]}"


@pytest.mark.slow
def test_a_stage_replicated_across_two_servers_equals_single_process_training(tmp_path):
    _two_nodes(tmp_path, str(ROOT / "tests" / "runtime" / "two_servers.py"), str(tmp_path / "out.json"))
    results = json.loads((tmp_path / "out.json").read_text())
    assert sorted(r["stage"] for r in results) == [0, 1, 1, 2]
    for rank, res in enumerate(results):
        assert res["loss"] <= TOL, (rank, res["loss"])
        assert all(e <= TOL for e in res["grads"].values()), (rank, res["grads"])


@pytest.mark.slow
def test_probe_under_two_nodes_writes_a_two_server_cluster(tmp_path):
    _two_nodes(tmp_path, "-m", "dapple.cli", "probe", "-o", str(tmp_path / "cluster.yaml"), "--repeats", "1")
    cluster = Cluster.load(tmp_path / "cluster.yaml")
    assert (cluster.servers, cluster.devices_per_server) == (2, 2)
    assert cluster.inter_bandwidth > 0 and cluster.meta["hosts"][0].endswith("(node 0)")
