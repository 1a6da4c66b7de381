"""Bandwidth probe: the least-squares fit, and a real 3-process gloo measurement on this machine."""

from __future__ import annotations

import pytest

from dapple import Cluster
from dapple.profiler.probe.links import fit_line, probe_local
from tests.runtime._spawn import STALL_LIMIT, reported, stall_until_reported


def test_fit_recovers_latency_and_bandwidth():
    sizes = [1e3, 1e5, 1e6, 1e7]
    lat, bw = fit_line(sizes, [50e-6 + n / 2e9 for n in sizes])
    assert lat == pytest.approx(50e-6, rel=1e-6) and bw == pytest.approx(2e9, rel=1e-6)
    # a 5% slower largest transfer: an unweighted fit's intercept moves by 17% (166 us); relative residuals
    # keep the small sizes' latency
    sizes = [2 ** k for k in range(10, 25, 2)]
    noisy = [(200e-6 + n / 1e9) * (1.05 if n == sizes[-1] else 1.0) for n in sizes]
    lat, bw = fit_line(sizes, noisy)
    assert lat == pytest.approx(200e-6, rel=0.02) and bw == pytest.approx(1e9, rel=0.05)
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_line([1e3, 1e3], [1.0, 1.0])
    with pytest.raises(ValueError, match="too noisy"):
        fit_line([1e3, 1e6], [2e-3, 1e-3])


def test_probe_three_local_processes(tmp_path):
    fits = probe_local(3, sizes=(1 << 16, 1 << 20, 1 << 23), repeats=3)
    assert fits["servers"] == 1 and fits["devices_per_server"] == 3 and fits["inter"] is None
    lat, bw = fits["intra"]
    assert 0 <= lat < 0.01 and 1e6 < bw < 1e12  # loopback: under 10 ms, between a MB/s and a TB/s
    assert fits["allreduce"][1] > 1e6
    assert sorted(fits["allreduce_by_size"]) == [2, 3] and fits["allreduce_by_size"][3] == fits["allreduce"]
    assert fits["allreduce_by_size"][2][1] > 1e6  # a group of ranks 0, 1 measured on its own
    cluster = Cluster.from_probe(fits, device_memory=1e9)  # what Cluster.local(3) does with these fits
    assert cluster.intra_bandwidth == bw and cluster.intra_allreduce_bandwidth == fits["allreduce"][1]
    two = fits["allreduce_by_size"][2]
    assert cluster.allreduce_link([0, 1]) == (two[1], two[0])
    from dapple.profiler.probe.sharing import verdict
    sh = fits["link_sharing"]["intra"]  # rank 0 sent to ranks 1 and 2 at once: which lands when
    assert sh["receivers"] == [1, 2] and sh["bytes"] == 1 << 23
    assert 0 < sh["solo_s"] and 0 < sh["first_s"] <= sh["last_s"]
    assert sh["verdict"] == verdict(sh["solo_s"], sh["first_s"], sh["last_s"])
    assert cluster.link_sharing == (sh["verdict"] if sh["verdict"] != "independent" else "held")
    cluster.save(tmp_path / "local.yaml")
    assert Cluster.load(tmp_path / "local.yaml") == cluster


def _two_servers() -> dict:
    import os

    import torch.distributed as dist

    from dapple.profiler.probe.links import measure
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
    assert list(f["link_sharing"]) == ["inter"]  # rank 0 to ranks 2 and 3 (2 per server: no intra probe)
    assert f["link_sharing"]["inter"]["receivers"] == [2, 3] and f["link_sharing"]["inter"]["first_s"] > 0
    c = Cluster.from_probe(f)
    assert c.servers == 2 and c.inter_allreduce_bandwidth == f["allreduce"][1]
    assert c.intra_allreduce_bandwidth == f["allreduce_intra"][1]


def _logged_rounds() -> tuple[list[int], list[int]]:
    import torch.distributed as dist

    from dapple.profiler.probe import links as bandwidth
    dist.init_process_group("gloo")
    log: dict[str, list[int]] = {"ar": [], "p2p": []}
    real_ar, real_send = dist.all_reduce, dist.isend

    def all_reduce(t, *a, **k):
        if t.numel() > 1:  # not the timed barriers (one number each)
            log["ar"].append(t.numel() * 4)
        return real_ar(t, *a, **k)

    def isend(t, *a, **k):
        log["p2p"].append(t.numel() * 4)
        return real_send(t, *a, **k)

    dist.all_reduce, dist.isend = all_reduce, isend
    times = bandwidth.allreduce_times(sizes=(1024, 4096, 16384), repeats=2)
    one_way = bandwidth.ping_pong(0, 1, sizes=(1024, 4096, 16384), repeats=2)
    assert sorted(times) == [1024, 4096, 16384] and all(t > 0 for t in times.values())
    assert sorted(one_way) == ([1024, 4096, 16384] if dist.get_rank() == 0 else [])
    return log["ar"], log["p2p"]


def test_probe_rounds_time_every_size_once():
    # a burst of load lasting a few transfers must not slow every repeat of one size (the fit bends)
    from tests.runtime._spawn import run_ranks

    ar, p2p = run_ranks(_logged_rounds, 2, timeout=120)[0]
    assert ar == [1024, 4096, 16384] * 3  # the connection round, then 2 timed rounds
    assert p2p == [1024, 4096, 16384] * 3


def _probe_without_a_peer(what: str) -> str | None:
    """Rank 1 stalls until rank 0 has reported instead of probing; rank 0 runs ``what`` ("ping_pong" or "measure", 1 s
    timeout) and returns the error it gets, after how many seconds."""
    import time

    import torch.distributed as dist

    from dapple.profiler.probe import links as bandwidth
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        stall_until_reported("probe", 1)
        return None
    start = time.perf_counter()
    try:
        if what == "ping_pong":
            bandwidth.ping_pong(0, 1, sizes=(1024, 4096), repeats=1, timeout=1.0)
        else:
            bandwidth.measure(sizes=(1024, 4096), repeats=1, timeout=1.0)
    except Exception as e:
        seen = f"{time.perf_counter() - start:.1f} {type(e).__name__}: {e}"
        reported("probe")
        return seen
    return "no error"


def test_measure_is_bounded_from_its_first_exchange():
    from tests.runtime._spawn import run_ranks

    msg = run_ranks(_probe_without_a_peer, 2, "measure", timeout=120)[0]
    seconds, text = msg.split(" ", 1)
    assert float(seconds) < STALL_LIMIT, msg  # the timeout, not the end of the peer's stall
    assert text.startswith("PipelineError: bandwidth probe, rank 0: creating its gloo group (does every rank call "
                           "measure?) failed or timed out (timeout 1s)"), msg


def test_probe_waits_are_bounded_and_say_what_they_waited_for():
    from tests.runtime._spawn import run_ranks

    msg = run_ranks(_probe_without_a_peer, 2, "ping_pong", timeout=120)[0]
    seconds, text = msg.split(" ", 1)
    assert text.startswith("PipelineError: bandwidth probe, rank 0: barrier (before the 1024-byte ping-pong of "
                           "ranks 0 and 1) failed or timed out (timeout 1s)"), msg
    assert float(seconds) < STALL_LIMIT, msg  # the timeout, not the end of the peer's stall


def test_cli_probe_writes_a_cluster(tmp_path):
    from dapple.cli import main

    out = tmp_path / "cluster.yaml"
    assert main(["probe", "--nproc", "2", "--repeats", "2", "-o", str(out)]) == 0
    c = Cluster.load(out)
    assert c.num_devices == 2 and c.intra_allreduce_bandwidth is not None


@pytest.mark.parametrize("kw, message", [
    ({"repeats": 0}, "repeats: expected a positive integer .* got 0"),
    ({"sizes": (1024,)}, r"sizes: expected two or more distinct positive byte counts .* got \[1024\]"),
    ({"sizes": (1024, 1024.5)}, r"got \[1024, 1024.5\]"),
    ({"world_size": 1}, "world_size must be an integer >= 2 .* got 1"),
])
def test_probe_arguments_are_checked_before_any_process_starts(kw, message):
    with pytest.raises(ValueError, match=message):
        probe_local(**{"world_size": 2, **kw})  # spawning would take seconds; these fail at once


def test_cli_probe_rejects_zero_repeats():
    from dapple.cli import main

    with pytest.raises(SystemExit, match="dapple probe: repeats: expected a positive integer"):
        main(["probe", "--nproc", "2", "--repeats", "0"])


def test_link_sharing_verdict():
    from dapple.profiler.probe.sharing import verdict

    assert verdict(1.0, 1.0, 2.0) == "held"  # the first send landed after one send's time, the second after two
    assert verdict(1.0, 1.9, 2.0) == "shared"  # both landed together, after two sends' time
    assert verdict(1.0, 1.0, 1.1) == "independent"  # neither slowed the other
    with pytest.raises(ValueError, match=r"solo arrival must be a positive time, got 0\.0 s"):
        verdict(0.0, 1.0, 2.0)


def test_cluster_takes_the_probed_link_sharing():
    def probe(v: str, first: float) -> dict:
        return {"receivers": [1, 2], "bytes": 1 << 24, "solo_s": 1.0, "first_s": first, "last_s": 2.0, "verdict": v}

    base = {"servers": 2, "devices_per_server": 4, "intra": (1e-5, 1e10), "inter": (5e-5, 1e9), "hosts": ["a", "b"]}
    c = Cluster.from_probe({**base, "link_sharing": {"intra": probe("held", 1.0), "inter": probe("shared", 2.0)}})
    assert c.link_sharing == "shared"  # the links between servers decide
    assert c.meta["link_sharing_probe"]["intra"] == {"verdict": "held", "first_over_last": 0.5,
                                                     "last_over_solo": 2.0, "bytes": 1 << 24}
    assert Cluster.from_probe({**base, "link_sharing": {"intra": probe("held", 1.0)}}).link_sharing == "held"
    assert Cluster.from_probe({**base, "link_sharing": {"inter": probe("independent", 1.0)}}).link_sharing == "held"
    assert Cluster.from_probe(base).link_sharing == "held" and "link_sharing_probe" not in Cluster.from_probe(base).meta
