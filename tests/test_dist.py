"""dapple/_dist.py: which device a process group's tensors live on, and the timeout check."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dapple import _dist


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
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert _dist.group_device() == torch.device(want)


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
