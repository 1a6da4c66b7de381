"""ActivationMeter: bytes autograd holds for backward, counted while alive, parameters excluded."""

from __future__ import annotations

import torch
from torch import nn

from dapple.runtime import ActivationMeter


def test_meter_counts_saved_activations_until_backward_frees_them():
    torch.manual_seed(0)
    lin = nn.Linear(16, 16).double()
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    with ActivationMeter(lin.parameters()) as m:
        y = torch.tanh(lin(x))  # saves x (input of the matmul) and y (tanh's output); the weight is excluded
        assert m.now == 2 * 8 * 16 * 8
        z = torch.tanh(lin(y))  # y again (already counted) and z
        assert m.now == 3 * 8 * 16 * 8
        z.sum().backward()
    assert m.now == 0 and m.peak == 3 * 8 * 16 * 8


def test_early_backward_holds_one_micro_batch_gpipe_style_holds_all():
    lin = nn.Linear(4, 4)

    def peak(order: str) -> int:
        with ActivationMeter(lin.parameters()) as m:
            if order == "all forwards first":
                outs = [torch.tanh(lin(torch.randn(2, 4, requires_grad=True))) for _ in range(3)]
                for o in outs:
                    o.sum().backward()
            else:  # each backward right after its forward
                for _ in range(3):
                    torch.tanh(lin(torch.randn(2, 4, requires_grad=True))).sum().backward()
        assert m.now == 0
        return m.peak

    assert peak("all forwards first") == 3 * peak("interleaved") > 0
