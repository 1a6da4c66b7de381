"""Inputs by name: traced with only those as the model's inputs (the rest at their defaults), in forward's order."""

from __future__ import annotations

import pytest
import torch

import dapple
from dapple.profiler import trace_layers
from dapple.profiler.by_name import by_position
from tests.conftest import EXPORT_OK
from tests.runtime.model_io_workers import PadMasked, padded, seq_loss

FAST = dict(repeats=1, warmup=0, device="cpu")


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_model_traced_by_name_takes_those_inputs_first(tracer):
    if tracer == "export" and not EXPORT_OK:
        pytest.skip("needs torch.export")
    torch.manual_seed(0)
    model = PadMasked().double()
    xs, y = padded(4, 6, torch.Generator().manual_seed(0))
    reordered = {"pad_mask": xs["pad_mask"], "tokens": xs["tokens"]}  # any order: forward's is kept
    lg = trace_layers(model, tracer=tracer, example_inputs=reordered)
    assert lg.inputs[:2] == ["tokens", "pad_mask"]  # fx: then scale, fixed at its default
    assert torch.equal(lg.gm(xs["tokens"], xs["pad_mask"]), model(**xs))
    prof = dapple.profile(model, reordered, seq_loss, targets=y, tracer=tracer, **FAST)
    assert prof.meta["tracing"]["by_name"] and [i["name"] for i in prof.meta["tracing"]["inputs"]] == ["tokens",
                                                                                                         "pad_mask"]


def test_names_the_model_does_not_take_or_lacks():
    xs, _ = padded(4, 6, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"example_inputs: \['mask'\] are not arguments of PadMasked.forward "
                                         r"\['tokens', 'pad_mask', 'scale'\]"):
        trace_layers(PadMasked(), example_inputs={"tokens": xs["tokens"], "mask": xs["pad_mask"]})
    with pytest.raises(ValueError, match=r"PadMasked.forward needs \['tokens'\], which the inputs by name "
                                         r"\(\['pad_mask'\]\) lack"):
        trace_layers(PadMasked(), example_inputs={"pad_mask": xs["pad_mask"]})
    with pytest.raises(TypeError, match=r"example_inputs\['tokens'\]: expected a tensor .* got list"):
        dapple.profile(PadMasked(), {"tokens": [1, 2]}, **FAST)


def test_by_position_puts_names_in_the_traced_order():
    assert by_position({"b": 2, "a": 1}, ["a", "b", "c"], "inputs") == (1, 2)
    assert by_position({"c": 3}, ["a", "b", "c"], "inputs") == (None, None, 3)  # not given on this rank
    with pytest.raises(ValueError, match=r"example_inputs: \['a', 'b'\] not given, but the traced model takes them "
                                         r"before 'c'"):
        by_position({"c": 3}, ["a", "b", "c"], "example_inputs", gaps=False)
    with pytest.raises(ValueError, match=r"inputs: \['d'\] are not inputs of the traced model, which takes "
                                         r"\['a', 'b'\]"):
        by_position({"d": 3}, ["a", "b"], "inputs")
