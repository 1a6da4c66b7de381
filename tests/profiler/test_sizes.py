"""Byte counting: saved tensors by storage (views once, parameters out), tensors crossing a cut."""

from __future__ import annotations

import torch
from torch import nn

from dapple.profiler.sizes import SavedTensors, state_storages, tensor_bytes


def test_saved_storages_counted_once_and_parameters_excluded():
    lin = nn.Linear(8, 4)
    x = torch.randn(5, 8, requires_grad=True)
    with SavedTensors(exclude=state_storages([lin])) as saved:
        h = lin(x)  # saves x (5, 8); the weight is a parameter
        y = h * h  # saves h twice (both operands): one storage
        z = h[:2].exp()  # exp saves its result (2, 4), a new storage
    assert saved.total == (5 * 8 + 5 * 4 + 2 * 4) * 4
    assert saved.bytes_of(x) == 5 * 8 * 4 and saved.bytes_of(h.view(-1)) == 5 * 4 * 4
    assert saved.bytes_of((y,)) == 0
    del z


def test_saved_view_keeps_its_whole_storage():
    x = torch.randn(10, 10, requires_grad=True)
    base = x * 1
    with SavedTensors(exclude=set()) as saved:
        base[:1].sin()  # sin saves its input: a (1, 10) view of a (10, 10) storage
    assert saved.total == 10 * 10 * 4


def test_tensor_bytes_of_nested_values():
    value = (torch.zeros(3, 2), [torch.zeros(4, dtype=torch.float16), 7], {"k": torch.zeros(1, dtype=torch.long)})
    assert tensor_bytes(value) == 3 * 2 * 4 + 4 * 2 + 8
