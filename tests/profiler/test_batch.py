"""Example batches: resizing along dim 0, batch-size checks, errors naming the value."""

from __future__ import annotations

import pytest
import torch

from dapple.profiler.batch import as_tensors, check_batch_sizes, common_batch_size, resize, to_model


def test_resize_takes_first_rows_or_repeats_them():
    t = torch.arange(6).reshape(3, 2)
    assert torch.equal(resize(t, 2), t[:2])
    assert torch.equal(resize(t, 7)[:, 0], torch.tensor([0, 2, 4, 0, 2, 4, 0]))
    assert resize(t, 3) is t


def test_batch_sizes_sorted_distinct_and_defaulted():
    assert check_batch_sizes([8, 4, 8], example=2) == [4, 8]
    assert check_batch_sizes(None, example=8) == [4, 8]
    assert check_batch_sizes(None, example=1) == [1]
    assert check_batch_sizes(16, example=1) == [16]
    with pytest.raises(ValueError, match=r"got \[2, -1\] \(bad: \[-1\]\)"):
        check_batch_sizes([2, -1], example=2)
    with pytest.raises(ValueError, match=r"bad: \[2.5\]"):
        check_batch_sizes([2.5], example=2)


def test_common_batch_size_names_the_disagreeing_tensors():
    assert common_batch_size({"x": torch.zeros(3, 2), "y": torch.zeros(3)}) == 3
    with pytest.raises(ValueError, match=r"x \(3, 2\), y \(4,\)"):
        common_batch_size({"x": torch.zeros(3, 2), "y": torch.zeros(4)})
    with pytest.raises(ValueError, match="y: expected a tensor with a batch dimension"):
        common_batch_size({"x": torch.zeros(3, 2), "y": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="empty"):
        common_batch_size({"x": torch.zeros(0, 2)})


def test_as_tensors_and_dtype_follows_the_model():
    assert len(as_tensors([torch.zeros(1), torch.ones(1)], "inputs")) == 2
    with pytest.raises(TypeError, match=r"inputs: expected a tensor or a non-empty tuple"):
        as_tensors([], "inputs")
    assert to_model(torch.zeros(2), torch.device("cpu"), torch.float64).dtype == torch.float64
    assert to_model(torch.zeros(2, dtype=torch.long), torch.device("cpu"), torch.float64).dtype == torch.long
