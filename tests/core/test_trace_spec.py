"""The tracing a profile records and a plan carries: YAML round trip and validation."""

from __future__ import annotations

import pytest

from dapple import Plan
from dapple.core.documents import DocumentError
from dapple.core.trace_spec import InputSpec, TraceSpec
from dapple.planner import Stage

SPEC = TraceSpec("export", (InputSpec("input_ids", (4, 8), "int64"), InputSpec("attention_mask", (4, 8), "int64")),
                 by_name=True, concrete_args={"attn_mask": None, "scale": 0.5}, leaf_modules=("blocks.0", "class:m.B"),
                 unrecorded=("dynamic_shapes",))


def test_a_plan_keeps_its_tracing_in_yaml(tmp_path):
    plan = Plan(8, 4, [Stage((0, 2), [0]), Stage((2, 3), [1])], tracing=SPEC)
    plan.save(tmp_path / "p.yaml")
    again = Plan.load(tmp_path / "p.yaml")
    assert again.tracing == SPEC and again == plan
    assert TraceSpec.from_dict(TraceSpec("fx").to_dict()) == TraceSpec("fx")  # the optional fields left out
    assert Plan(8, 4, [Stage((0, 3), [0])]).to_dict().get("tracing") is None


@pytest.mark.parametrize("doc, message", [
    ({"tracer": "auto", "inputs": []}, r"tracing.tracer: expected one of \('fx', 'export'\), got 'auto'"),
    ({"tracer": "fx", "inputs": [], "concrete_args": {"m": [1]}}, r"concrete_args: expected plain values"),
    ({"tracer": "fx", "inputs": [{"name": "x", "shape": [2, -1], "dtype": "float32"}]}, r"shape\[1\]: expected"),
    ({"tracer": "fx", "inputs": [], "leaf": ["a"]}, r"unknown field 'leaf'; known: tracer, inputs, by_name"),
    ({"tracer": "fx", "inputs": [], "leaf_modules": "blocks.0"}, r"leaf_modules: expected a list of strings"),
])
def test_a_bad_tracing_document_is_named(doc, message):
    with pytest.raises(DocumentError, match=message):
        TraceSpec.from_dict(doc, "p.yaml.tracing")


def test_a_plan_refuses_a_tracing_that_is_no_trace_spec():
    with pytest.raises(ValueError, match=r"Plan.tracing: expected a TraceSpec or None, got dict"):
        Plan(8, 4, [Stage((0, 3), [0])], tracing={"tracer": "fx"})
