"""Bandwidth probe: the least-squares fit, and a real 2-process gloo measurement on this machine."""

from __future__ import annotations

import pytest

from dapple import Cluster
from dapple.profiler.bandwidth import fit_line, probe_local


def test_fit_recovers_latency_and_bandwidth():
    sizes = [1e3, 1e5, 1e6, 1e7]
    lat, bw = fit_line(sizes, [50e-6 + n / 2e9 for n in sizes])
    assert lat == pytest.approx(50e-6, rel=1e-6) and bw == pytest.approx(2e9, rel=1e-6)
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_line([1e3, 1e3], [1.0, 1.0])
    with pytest.raises(ValueError, match="too noisy"):
        fit_line([1e3, 1e6], [2e-3, 1e-3])


def test_probe_two_local_processes(tmp_path):
    fits = probe_local(2, sizes=(1 << 16, 1 << 20, 1 << 24), repeats=5)
    assert fits["servers"] == 1 and fits["devices_per_server"] == 2 and fits["inter"] is None
    lat, bw = fits["intra"]
    assert lat >= 0 and 1e6 < bw < 1e12  # loopback moves between a MB/s and a TB/s
    assert fits["allreduce"][1] > 1e6
    cluster = Cluster.from_probe(fits, device_memory=1e9)  # what Cluster.local(2) does with these fits
    assert cluster.intra_bandwidth == bw and cluster.intra_allreduce_bandwidth == fits["allreduce"][1]
    cluster.save(tmp_path / "local.yaml")
    assert Cluster.load(tmp_path / "local.yaml") == cluster


def _two_servers() -> dict:
    import os

    import torch.distributed as dist

    from dapple.profiler.bandwidth import measure
    rank = int(os.environ["RANK"])
    os.environ["DAPPLE_PROBE_HOST"] = "server-a" if rank < 2 else "server-b"
    dist.init_process_group("gloo")
    return measure(sizes=(1 << 16, 1 << 20, 1 << 24), repeats=3)


def test_probe_groups_ranks_into_servers_by_host():
    from tests.runtime._spawn import run_ranks

    fits = run_ranks(_two_servers, 4, timeout=120)
    assert all(f == fits[0] for f in fits)  # every rank gets rank 0's fits
    f = fits[0]
    assert (f["servers"], f["devices_per_server"], f["hosts"]) == (2, 2, ["server-a", "server-b"])
    assert f["intra"][1] > 1e6 and f["inter"][1] > 1e6 and f["allreduce_intra"][1] > 1e6
    c = Cluster.from_probe(f)
    assert c.servers == 2 and c.inter_allreduce_bandwidth == f["allreduce"][1]
    assert c.intra_allreduce_bandwidth == f["allreduce_intra"][1]


def test_cli_probe_writes_a_cluster(tmp_path):
    from dapple.cli import main

    out = tmp_path / "cluster.yaml"
    assert main(["probe", "--nproc", "2", "--repeats", "2", "-o", str(out)]) == 0
    c = Cluster.load(out)
    assert c.num_devices == 2 and c.intra_allreduce_bandwidth is not None
