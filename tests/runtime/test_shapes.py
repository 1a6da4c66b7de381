"""Boundary shapes from meta propagation: per slice rows and input shape, cached; clear errors otherwise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dapple.models import GPT
from dapple.profiler import trace_layers
from dapple.runtime.shapes import BoundaryShapes, ShapeError, Spec, input_key
from dapple.runtime.stages import split_stages
from tests.cut_models import BiasNet, FlatNet


def _shapes(model, cuts):
    lg = trace_layers(model)
    stages = split_stages(lg, cuts)
    return BoundaryShapes(lg.gm, ["x"], [s.send for s in stages[:-1]])


def test_gpt_boundary_per_rows_and_sequence_length():
    model = GPT(n_layer=2, n_embd=8, n_head=2, vocab_size=20, block_size=16).double()
    shapes = _shapes(model, [(0, 4), (4, 7)])
    key8 = input_key([torch.zeros(4, 8, dtype=torch.long)])
    assert shapes.specs(key8, 3) == [[Spec((3, 8, 8), torch.float64, True)]]
    assert shapes.specs(input_key([torch.zeros(4, 5, dtype=torch.long)]), 2) == [[Spec((2, 5, 8), torch.float64,
                                                                                       True)]]
    assert shapes.specs(key8, 3) is shapes.specs(key8, 3)  # cached


class Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):  # (B, T, 4) -> the boundary is (T, B, 4)
        return self.b(self.a(x).transpose(0, 1))


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.a.requires_grad_(False)

    def forward(self, x):
        return self.b(self.a(x))


def test_boundary_must_be_batch_first():
    shapes = _shapes(Transposed(), [(0, 1), (1, 2)])
    with pytest.raises(ValueError, match=r"'transpose' crosses the cut after stage 0, and cannot be sent: its shape "
                                         r"is \(5, 2, 4\) for 2 rows and \(5, 3, 4\) for 3 rows: the batch rows are "
                                         r"not in dimension 0"):
        shapes.specs(input_key([torch.zeros(8, 5, 4)]), 3)


def test_frozen_first_stage_sends_no_gradient():
    shapes = _shapes(Frozen(), [(0, 1), (1, 2)])
    assert shapes.specs(input_key([torch.zeros(8, 4)]), 2) == [[Spec((2, 4), torch.float32, False)]]


class Checked(nn.Module):
    """A check on values: the meta device cannot run it (shape inference runs it on the CPU, on zeros)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if not torch.isfinite(x).all():
            raise ValueError("non-finite")
        return self.fc(x)


class Picky(nn.Module):
    def forward(self, x):
        raise ValueError(f"picky about {tuple(x.shape)}")


def _leaf_shapes(leaf):
    model = nn.Sequential(nn.Linear(4, 4), leaf, nn.Linear(4, 2))
    lg = trace_layers(model, leaf_modules=[type(leaf)])
    stages = split_stages(lg, [(0, 1), (1, 2), (2, 3)])
    places = {n.name: (lg.names[k], k) for n, k in lg.layer_of.items()}  # one layer per stage here
    return BoundaryShapes(lg.gm, ["input"], [s.send for s in stages[:-1]], places)


def test_a_leaf_the_meta_device_cannot_run_is_run_on_the_cpu():
    shapes = _leaf_shapes(Checked())
    assert shapes.specs(input_key([torch.zeros(8, 4)]), 3) == [[Spec((3, 4), torch.float32, True)]] * 2


def test_a_failure_names_the_layer_the_stage_and_the_input_shapes():
    shapes = _leaf_shapes(Picky())
    with pytest.raises(ShapeError, match=r"^shape inference \(meta device\) failed in layer '1' \(stage 1\) at "
                                         r"node '_1' \(call_module 1\), "
                                         r"for a slice of 3 rows of inputs input \(3, 5, 4\) float32: "
                                         r"ValueError: picky about \(3, 5, 4\)$"):
        shapes.specs(input_key([torch.zeros(8, 5, 4)]), 3)


def test_a_bias_without_batch_rows_is_sent_whole():
    lg = trace_layers(BiasNet().double())
    stages = split_stages(lg, [(0, 2), (2, 3), (3, 5)])  # the bias crosses both cuts (relayed by blocks.1)
    shapes = BoundaryShapes(lg.gm, ["x"], [s.send for s in stages[:-1]])
    key = input_key([torch.zeros(8, 6, 4, dtype=torch.float64)])
    for rows in (1, 3):
        got = {name: spec for cut, s in zip(shapes.specs(key, rows), stages) for name, spec in zip(s.send, cut)}
        assert got["unsqueeze"] == Spec((1, 6, 6), torch.float64, True, whole=True)  # the same for any rows
        assert got["add_1"] == Spec((rows, 6, 8), torch.float64, True)
    assert shapes.whole(key) == [[v == "unsqueeze" for v in s.send] for s in stages[:-1]]


def test_a_value_no_cut_may_carry_names_the_layers_on_both_sides():
    lg = trace_layers(FlatNet())
    stages = split_stages(lg, [(0, 2), (2, 4)])
    shapes = BoundaryShapes(lg.gm, ["x"], [s.send for s in stages[:-1]], cuts=[("flat", "unflat")])
    with pytest.raises(ValueError, match=r"^value 'tanh' crosses the cut after stage 0, between layers 'flat' and "
                                         r"'unflat', and cannot be sent: its shape is \(12, 8\) for 2 rows and "
                                         r"\(18, 8\) for 3 rows: the batch rows are not in dimension 0\. .* What to "
                                         r"do: cut elsewhere"):
        shapes.specs(input_key([torch.zeros(8, 6, 4)]), 4)
