"""What a cut carries: batch rows, a whole tensor, or something no cut may carry, told from shapes at two row counts."""

from __future__ import annotations

import pytest
import torch

import dapple
from dapple.profiler import trace_layers
from dapple.profiler.boundary import ROWS, WHOLE, data_dependent, value_kind, why_not
from tests.cut_models import BiasNet, FlatNet, seq_loss

FAST = dict(repeats=1, warmup=0, device="cpu")


@pytest.mark.parametrize("shapes, kind", [
    ({2: (2, 5), 3: (3, 5)}, ROWS),
    ({2: (1, 2, 5, 5), 3: (1, 2, 5, 5)}, WHOLE),  # a position bias: the same for any rows
    ({2: (), 3: ()}, WHOLE),  # a scalar
    ({2: (10, 8), 3: (15, 8)}, None),  # batch and time flattened together
    ({2: (5, 2, 4), 3: (5, 3, 4)}, None),  # batch in dim 1
    ({2: None, 3: None}, None),  # not a tensor
    ({4: (4, 5)}, ROWS), ({4: (1, 5)}, WHOLE),  # seen at one count only
])
def test_value_kinds(shapes, kind):
    assert value_kind(shapes) == kind


def test_a_value_without_batch_rows_made_from_the_batch_cannot_go_whole():
    assert why_not("mean", {2: (8,), 3: (8,)}, {"mean"}) == (
        "its shape is (8,) for 2 rows and (8,) for 3 rows, without batch rows, but it is computed from the batch's "
        "values (each replica's would differ)")
    assert why_not("bias", {2: (1, 5, 5), 3: (1, 5, 5)}, {"mean"}) is None
    assert why_not("size", {2: None, 3: None}, set()) == "it is not a tensor"


def test_the_bias_depends_on_parameters_and_sizes_only():
    lg = trace_layers(BiasNet())
    dependent = data_dependent(lg.gm)
    crossing = {n.name for n in lg.crossing(1)}
    assert crossing == {"unsqueeze", "add_1"}  # the bias, and the hidden state
    assert "unsqueeze" not in dependent and "add_1" in dependent


def test_the_profile_marks_the_boundaries_no_plan_may_cut():
    x, y = torch.randn(4, 6, 4), torch.randint(0, 3, (4, 6))
    flat = dapple.profile(FlatNet(), x, seq_loss, targets=y, **FAST)
    assert [layer.cuttable for layer in flat.layers] == [True, False, True, True] and flat.uncuttable == [1]
    assert flat.meta["uncuttable"] == {"flat": "value 'tanh': its shape is (12, 8) for 2 rows and (24, 8) for 4 rows: "
                                               "the batch rows are not in dimension 0"}
    bias = dapple.profile(BiasNet(), x, seq_loss, targets=y, **FAST)  # the bias goes whole: every cut may run
    assert all(layer.cuttable for layer in bias.layers) and "uncuttable" not in bias.meta
    one = dapple.profile(FlatNet(), x, seq_loss, (4,), targets=y, **FAST)  # one batch size: told all the same
    assert one.uncuttable == [1]
