"""What a profile records of its tracing, and how dapple.pipeline's tracing arguments come from a plan's."""

from __future__ import annotations

import pytest
import torch

import dapple
from dapple.core.trace_spec import InputSpec, TraceSpec
from dapple.profiler import trace_layers
from dapple.profiler.trace_options import examples, traced_as
from tests.hf.models import Checked, CheckedNet
from tests.profiler.test_layers import Masked

FAST = dict(repeats=1, warmup=0, device="cpu")


@pytest.mark.filterwarnings("ignore:Was not able to add assertion")  # fx, on the tensor in concrete_args
def test_the_profile_records_the_tracer_options_and_example_shapes():
    x = torch.randn(4, 5, 6)
    prof = dapple.profile(CheckedNet(), x, tracer="fx", leaf_modules=[Checked, "head"], **FAST)
    spec = TraceSpec.from_dict(prof.meta["tracing"])
    assert spec == TraceSpec("fx", (InputSpec("x", (4, 5, 6), "float32"),),
                             leaf_modules=("class:tests.hf.models.Checked", "head"))
    masked = dapple.profile(Masked(), torch.randn(4, 4), concrete_args={"mask": None, "scale": torch.tensor(2.0)},
                            **FAST)
    spec = TraceSpec.from_dict(masked.meta["tracing"])
    assert spec.concrete_args == {"mask": None} and spec.unrecorded == ("concrete_args",)  # a tensor: not written


def test_the_plans_options_unless_given():
    spec = TraceSpec("fx", (InputSpec("x", (4, 5, 6), "float32"),), leaf_modules=("class:tests.hf.models.Checked",),
                     concrete_args={"flag": True})
    got = traced_as(spec, CheckedNet())
    assert got["tracer"] == "fx" and got["leaf_modules"] == [Checked] and got["concrete_args"] == {"flag": True}
    assert got["example_inputs"][0].shape == (2, 5, 6) and got["example_inputs"][0].dtype == torch.float32
    mine = traced_as(spec, CheckedNet(), tracer="export", leaf_modules=(), concrete_args={}, example_inputs="x")
    assert (mine["tracer"], mine["leaf_modules"], mine["concrete_args"], mine["example_inputs"]) == ("export", (), {},
                                                                                                   "x")
    assert traced_as(None, CheckedNet()) == dict(tracer="auto", concrete_args=None, leaf_modules=(),
                                                 example_inputs=None, dynamic_shapes=None)
    lg = trace_layers(CheckedNet(), **traced_as(spec, CheckedNet()) | {"concrete_args": None})  # the leaf: fx traces
    assert lg.names == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]


def test_inputs_by_name_come_back_as_a_dict_and_lost_options_are_asked_for():
    spec = TraceSpec("export", (InputSpec("input_ids", (4, 8), "int64"), InputSpec("attention_mask", (4, 8), "int64")),
                     by_name=True, unrecorded=("dynamic_shapes",))
    with pytest.raises(ValueError, match=r"traced the model with dynamic_shapes that a plan cannot record: pass "
                                         r"dynamic_shapes=... to dapple.pipeline"):
        traced_as(spec, CheckedNet())
    ex = examples(spec)
    assert list(ex) == ["input_ids", "attention_mask"] and ex["input_ids"].shape == (2, 8)
    assert ex["attention_mask"].dtype == torch.int64


def test_floating_examples_take_the_models_dtype():
    """A profile of a float32 model, a pipeline of its float64 copy: the traced graph checks the inputs' dtype."""
    spec = TraceSpec("export", (InputSpec("x", (4, 5, 6), "float32"), InputSpec("ids", (4, 5), "int64")))
    got = traced_as(spec, CheckedNet().double())["example_inputs"]
    assert [t.dtype for t in got] == [torch.float64, torch.int64]
