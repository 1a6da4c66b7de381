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
