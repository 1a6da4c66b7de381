"""The Plan's mixed_precision: YAML round-trip, validation naming the value, the table, what a run uses."""

from __future__ import annotations

import pytest
import yaml

from dapple import Plan
from dapple.core.documents import DocumentError
from dapple.core.plan import Stage


def _plan(**kw) -> Plan:
    return Plan(global_batch_size=8, micro_batch_size=4, stages=[Stage((0, 2), [0]), Stage((2, 4), [1])], **kw)


def test_mixed_precision_round_trips_and_only_then_is_written(tmp_path):
    _plan().save(tmp_path / "old.yaml")
    assert "mixed_precision" not in yaml.safe_load((tmp_path / "old.yaml").read_text())  # older readers see no change
    assert Plan.load(tmp_path / "old.yaml").mixed_precision is None
    plan = _plan(mixed_precision="bf16")
    plan.save(tmp_path / "p.yaml")
    doc = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert doc["mixed_precision"] == "bf16"
    assert Plan.load(tmp_path / "p.yaml") == plan
    doc["mixed_precision"] = "fp8"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(DocumentError, match=r"bad.yaml.mixed_precision: expected one of \('bf16', 'fp16'\) or None.*"
                                            r"got 'fp8'"):
        Plan.load(tmp_path / "bad.yaml")


def test_bad_mixed_precision_or_recompute_is_named():
    with pytest.raises(ValueError, match=r"Plan.mixed_precision: .*got 'half'"):
        _plan(mixed_precision="half")
    for bad in (1, "all"):
        with pytest.raises(ValueError, match=r"Plan.stages\[1\].recompute: expected one of \(False, True, 'layers', "
                                             rf"'selective'\), got {bad!r}"):
            Plan(8, 4, [Stage((0, 2), [0]), Stage((2, 4), [1], recompute=bad)])


def test_recompute_modes_round_trip_and_show_in_the_table(tmp_path):
    plan = Plan(12, 4, [Stage((0, 2), [0], recompute="layers"), Stage((2, 4), [1], recompute="selective"),
                        Stage((4, 6), [2], recompute=True)])
    plan.save(tmp_path / "p.yaml")
    assert [s.recompute for s in Plan.load(tmp_path / "p.yaml").stages] == ["layers", "selective", True]
    rows = str(plan).splitlines()[3:6]
    assert [r.split()[-1] for r in rows] == ["layers", "selective", "yes"]
    (tmp_path / "bad.yaml").write_text((tmp_path / "p.yaml").read_text().replace("selective", "some"))
    with pytest.raises(DocumentError, match=r"bad.yaml.stages\[1\].recompute: expected false, true, layers or "
                                            r"selective, got 'some'"):
        Plan.load(tmp_path / "bad.yaml")


def test_the_precision_a_run_uses():
    plan = _plan(mixed_precision="fp16")
    assert plan.precision() == "fp16" and plan.precision("bf16") == "bf16" and plan.precision("fp32") is None
    assert _plan().precision() is None
    with pytest.raises(ValueError, match=r"mixed_precision: expected one of \('bf16', 'fp16'\), 'fp32'.*got 'off'"):
        plan.precision("off")


def test_the_table_shows_precision_and_recompute():
    text = str(Plan(8, 4, [Stage((0, 2), [0], recompute=True), Stage((2, 4), [1])], mixed_precision="bf16"))
    head, columns, _, first, second = text.splitlines()[:5]
    assert head.endswith("mixed precision bf16")
    assert columns.split()[-1] == "recompute" and first.split()[-1] == "yes" and second.split()[-1] == "no"
    plain = str(_plan())
    assert "recompute" not in plain and "mixed precision" not in plain


def test_print_plan_shows_the_part_of_long_layer_names_that_tells_them_apart():
    names = [f"encoder.layers.encoder_layer_{i}" for i in range(12)] + ["model.decoder.final_layer_norm"]
    plan = Plan(global_batch_size=4, micro_batch_size=2, layer_names=names,
                stages=[Stage((0, 6), [0]), Stage((6, 13), [1])])
    text = str(plan)
    assert "~layers.encoder_layer_0 .. ~layers.encoder_layer_5" in text
    assert "~layers.encoder_layer_6 .. ~final_layer_norm" in text


def test_reduce_dtype_round_trips_and_a_bad_one_is_named(tmp_path):
    plan = Plan(global_batch_size=4, micro_batch_size=2, stages=[Stage((0, 2), [0, 1])], reduce_dtype="bf16")
    plan.save(tmp_path / "p.yaml")
    assert Plan.load(tmp_path / "p.yaml").reduce_dtype == "bf16"
    assert "reduce_dtype" not in Plan(global_batch_size=4, micro_batch_size=2, stages=[Stage((0, 2), [0])]).to_dict()
    with pytest.raises(ValueError, match=r"reduce_dtype: expected one of \('bf16', 'fp16', 'fp32'\).*got 'int8'"):
        Plan(global_batch_size=4, micro_batch_size=2, stages=[Stage((0, 2), [0])], reduce_dtype="int8")
