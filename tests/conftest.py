"""Shared test setup: seeded RNGs, one thread per process, the PipeDream profiles in profiles/pipedream."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PIPEDREAM = Path(os.environ.get("DAPPLE_PIPEDREAM_PROFILES", ROOT / "profiles" / "pipedream"))
# on a machine with fewer GPUs than a test's 2-4 ranks, the ranks share them (NCCL through host sockets)
os.environ.setdefault("DAPPLE_SHARE_GPUS", "1")
PIPEDREAM_MODELS = {  # file -> batch size it was profiled at (paper Table 2)
    "vgg19": 32, "resnet50": 128, "gnmt_16": 64, "bert_48": 2, "bert_large": 2, "xlnet_36": 1, "amoebanet_36": 1,
}


def _export_ok() -> bool:
    from dapple.profiler.export_trace import EXPORT_MIN_TORCH, _torch_version

    return _torch_version() >= EXPORT_MIN_TORCH


EXPORT_OK = _export_ok()  # dapple's torch.export tracer needs torch >= 2.9; fx works from 2.4
needs_export = pytest.mark.skipif(not EXPORT_OK, reason=f"tracer='export' needs torch >= 2.9, not {torch.__version__}")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    random.seed(0)
    torch.set_num_threads(1)
    yield
    # a test that leaves float64 as the default dtype changes every later test in this process
    assert torch.get_default_dtype() == torch.float32, f"the test left {torch.get_default_dtype()} as default dtype"


def pipedream_path(name: str) -> Path:
    path = PIPEDREAM / f"{name}.txt"
    if not path.exists():
        pytest.skip(f"PipeDream profile {path} not found (DAPPLE_PIPEDREAM_PROFILES?)")
    return path


def pipedream_profile(name: str):
    """The PipeDream profile ``name`` (profiles/pipedream) as a dapple Profile, at the batch size it was profiled at."""
    from dapple import Profile

    return Profile.from_pipedream(pipedream_path(name), PIPEDREAM_MODELS[name])
