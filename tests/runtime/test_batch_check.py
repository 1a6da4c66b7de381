"""The per-step batch checksums: exact per row in any layout, and bounded in memory whatever the batch's size."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dapple.runtime.batch_check import CHUNK, row_bits


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The checksum computed in one pass over the whole tensor (what row_bits must equal)."""
    x = t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return (x.flatten(1) if x.dim() > 1 else x.unsqueeze(1)).sum(1, dtype=torch.int64)


def _largest_allocation(fn) -> int:
    """Bytes of the largest CPU allocation ``fn`` makes (torch.profiler's memory events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)


@pytest.mark.parametrize("shape, dtype", [((37, 5, 3), torch.float32), ((300,), torch.int64),
                                          ((9, 1000), torch.bfloat16), ((64, 2, 4096), torch.float64),
                                          ((0, 8), torch.float32)])
def test_row_bits_in_blocks_equal_one_pass(shape, dtype):
    gen = torch.Generator().manual_seed(1)
    t = (torch.randn(shape, generator=gen) * 1e3).to(dtype)
    for chunk in (1, 7, 1000, CHUNK):
        assert torch.equal(row_bits(t, chunk), _plain(t)), chunk
    strided = torch.randn(shape[0], 6, generator=gen)[:, ::2]  # a non-contiguous view: the same rows' sums
    assert torch.equal(row_bits(strided, 5), _plain(strided.contiguous()))


def test_row_bits_reads_a_large_batch_in_bounded_blocks():
    big = torch.randn(8192, 1024)  # 32 MiB of float32; a one-pass int64 sum would allocate 64 MiB
    assert _largest_allocation(lambda: _plain(big)) >= big.numel() * 8  # (what the test guards against)
    largest = _largest_allocation(lambda: row_bits(big))
    assert largest <= CHUNK * 8 + big.shape[0] * 8, largest  # one block's int64 copy, plus the (rows,) result
    assert torch.equal(row_bits(big), _plain(big))
