"""dapple/core/dist.py: which device a process group's tensors live on, the timeout check, bounded waits."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from dapple.core import dist as _dist


@pytest.mark.parametrize("config, cuda, want", [
    ("cpu:gloo,cuda:gloo", False, "cpu"),
    ("cpu:gloo,cuda:gloo", True, "cpu"),  # gloo chosen on a GPU machine: the CPU, as before
    ("cuda:nccl", True, "cuda:3"),  # init_process_group() with no backend on a CUDA machine ("undefined")
    ("cpu:gloo,cuda:nccl", True, "cuda:3"),
    ("cpu:gloo", True, "cpu"),
])
def test_group_device_follows_the_backend_config(monkeypatch, config, cuda, want):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert _dist.group_device() == torch.device(want)


def _gpus(monkeypatch, count: int, local_rank: int, share: str | None) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    for name in ("NCCL_HOSTID", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    if share is None:
        monkeypatch.delenv(_dist.SHARE_GPUS, raising=False)
    else:
        monkeypatch.setenv(_dist.SHARE_GPUS, share)


def test_a_local_rank_beyond_the_gpus_is_refused_naming_both(monkeypatch):
    _gpus(monkeypatch, 2, 3, None)
    with pytest.raises(ValueError, match=r"LOCAL_RANK 3: this server has 2 CUDA device\(s\) \(cuda:0 .. cuda:1\); "
                                         r"start one process per GPU \(torchrun --nproc-per-node 2\)"
                                         r".*DAPPLE_SHARE_GPUS=1"):
        _dist.cuda_device()
    _gpus(monkeypatch, 2, 3, "0")
    with pytest.raises(ValueError, match="LOCAL_RANK 3"):
        _dist.cuda_device()


def test_shared_gpus_map_ranks_round_robin_with_a_host_id_each(monkeypatch):
    import os

    _gpus(monkeypatch, 2, 1, "1")
    assert _dist.cuda_device() == torch.device("cuda", 1)  # enough GPUs: its own, no NCCL settings
    assert "NCCL_HOSTID" not in os.environ
    _gpus(monkeypatch, 2, 3, "1")
    assert _dist.cuda_device() == torch.device("cuda", 1)
    assert os.environ["NCCL_HOSTID"] == "dapple-shared-gpu-rank-3"  # NCCL refuses two ranks of a host on a GPU
    assert os.environ["NCCL_SOCKET_IFNAME"] == "lo"  # one server: loopback


def test_group_device_names_backends_that_serve_no_device(monkeypatch):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"backends \{'cuda': 'nccl'\} serve neither CUDA \(available: False\)"):
        _dist.group_device()


def test_a_bare_init_process_group_is_read_from_its_config():
    """No backend given: get_backend() says 'undefined'; the config says what serves which device."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group(store=store, rank=0, world_size=1)
    try:
        assert dist.get_backend() == "undefined" or torch.cuda.is_available()
        want = "cuda" if torch.cuda.is_available() else "cpu"
        assert _dist.group_device().type == want
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bad", [0, -1, 0.0009, float("inf"), float("nan"), True, None, "5"])
def test_timeout_must_be_a_finite_number_of_milliseconds_or_more(bad):
    with pytest.raises(ValueError, match="timeout: expected a finite number of seconds >= 0.001 .* got"):
        _dist.timeout_seconds("timeout", bad)


def test_timeout_seconds_returns_a_float():
    assert _dist.timeout_seconds("timeout", 2) == 2.0 and isinstance(_dist.timeout_seconds("t", 2), float)


class _Work:
    """A stand-in for torch.distributed's Work: ``wait`` returns ``done`` or raises it."""

    def __init__(self, done):
        self.done = done

    def wait(self, timeout):
        if isinstance(self.done, Exception):
            raise self.done
        return self.done


def test_wait_for_names_the_step_when_the_wait_raises():
    with pytest.raises(_dist.PipelineError, match=r"^stage 1: recv of micro-batch 3 failed or timed out "
                                                  r"\(timeout 2s\): Timed out waiting 2000ms$"):
        _dist.wait_for(_Work(RuntimeError("Timed out waiting 2000ms\nat gloo/...")), 2,
                       "stage 1: recv of micro-batch 3")


def test_wait_for_treats_a_wait_that_returns_false_as_a_timeout():
    _dist.wait_for(_Work(True), 2, "fine")
    with pytest.raises(_dist.PipelineError, match=r"^stage 0: send of micro-batch 1 failed or timed out "
                                                  r"\(timeout 0.5s\): the wait returned False$"):
        _dist.wait_for(_Work(False), 0.5, "stage 0: send of micro-batch 1")


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_groups_outlast_dapples_waits(backend):
    # NCCL's watchdog kills the process at the group's timeout without dapple's error (stage, micro-batch):
    # dapple's wait, which may come a step after the op was posted, must time out first
    assert _dist.group_timeout(10.0, backend).total_seconds() == 2 * 10.0 + _dist.WATCHDOG_GRACE


def test_gloo_groups_take_the_timeout_as_is():
    assert _dist.group_timeout(2.5, "gloo").total_seconds() == 2.5


def test_free_ports_are_drawn_below_the_ephemeral_range(monkeypatch):
    # outgoing connections take local ports from the ephemeral range: a store's port there could be taken
    low, _ = _dist._ephemeral_ports()
    ports = {_dist.free_port() for _ in range(20)}
    assert all(10000 <= p < low for p in ports) and len(ports) > 1, (low, ports)
    monkeypatch.setattr(_dist, "_ephemeral_ports", lambda: (5000, 60999))  # no room below it: the OS's choice
    port = _dist.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
