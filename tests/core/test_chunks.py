"""Chunks of one device group: the loop and V orders, their validation naming the stage and device, and a Plan
holding them (YAML, the table, the schedules that run them, their K_i)."""

from __future__ import annotations

import pytest
import yaml

from dapple import Plan
from dapple.core.chunks import chunk_layout, group_order
from dapple.core.documents import DocumentError
from dapple.core.plan import Stage

GROUPS = {0: [0, 1], 1: [2], 2: [3]}  # a replicated group and two single devices


def _stages(order: list[int], groups: dict = GROUPS) -> list[Stage]:
    return [Stage((i, i + 1), groups[g]) for i, g in enumerate(order)]


def test_group_orders():
    assert group_order(4, 2, "loop") == [0, 1, 2, 3, 0, 1, 2, 3]
    assert group_order(4, 2, "V") == [0, 1, 2, 3, 3, 2, 1, 0]
    assert group_order(2, 3, "loop") == [0, 1, 0, 1, 0, 1]
    with pytest.raises(ValueError, match=r"'V' with two chunks per device group, got 'V' with 3"):
        group_order(2, 3, "V")


def test_layouts_of_one_stage_per_group_loop_and_v():
    one = chunk_layout([[0, 1], [2], [3]])
    assert (one.chunks, one.placements, one.group_of) == (1, (), (0, 1, 2))
    loop = chunk_layout([GROUPS[g] for g in [0, 1, 2, 0, 1, 2]])
    assert (loop.chunks, loop.placements, loop.stages_of(1), loop.chunk_of(4)) == (2, ("loop",), [1, 4], 1)
    v = chunk_layout([GROUPS[g] for g in [0, 1, 2, 2, 1, 0]])
    assert (v.placements, v.stages_of(0), v.same_group(2, 3), v.same_group(1, 2)) == (("V",), [0, 5], True, False)
    assert chunk_layout([[0, 1], [0, 1]]).placements == ("loop", "V")  # a single group: both orders
    assert v.group_of_device(1) == 0 and v.group_of_device(3) == 2


@pytest.mark.parametrize("devices, message", [
    ([[0, 1], [1, 0]], r"stages\[1\].devices: device 1 is already in stage 0 \(devices \[0, 1\]\); stages on one "
                       r"device group .* same order, got \[1, 0\]"),
    ([[0, 1], [1, 2]], r"stages\[1\].devices: device 1 is already in stage 0"),
    ([[0, 0]], r"stages\[0\].devices: device 0 is listed twice in stage 0"),
    ([[0], [1], [0]], r"device group \[1\] holds 1 chunk\(s\) \(stages \[1\]\) but device group \[0\] holds 2 \(stages "
                      r"\[0, 2\]\)"),
    ([[0], [0], [1], [1]], r"stages\[1\] \(devices \[0\], chunk 1 of its device group\) breaks the chunk orders: with "
                           r"2 device groups of 2 chunks, stage 1 belongs on devices \[1\]"),
    ([[0], [1], [0], [1], [1], [0]], r"stages\[4\] \(devices \[1\], chunk 2 .*3 chunks, stage 4 belongs on "
                                     r"devices \[0\]; .*then again \(loop\)$"),
])
def test_bad_layouts_name_the_stage_and_device(devices, message):
    with pytest.raises(ValueError, match=message):
        chunk_layout(devices)


def test_a_chunked_plan_round_trips_through_yaml_and_derives_its_warmups(tmp_path):
    plan = Plan(16, 2, _stages([0, 1, 2, 2, 1, 0]), schedule="zb-v", layer_names=[f"l{i}" for i in range(6)])
    assert plan.num_devices == 4 and plan.num_stages == 6 and plan.placement == "V"
    assert plan.stages_of_device(1) == [0, 5] and plan.stages_of_device(3) == [2, 3]
    assert (plan.device_label(1), plan.device_label(3)) == ("stages 0, 5", "stages 2, 3")  # (for messages)
    straight = Plan(4, 2, [Stage((0, 1), [0]), Stage((1, 2), [1])], layer_names=["a", "b"])
    assert straight.device_label(1) == "stage 1"
    assert plan.warmup == [6, 5, 4, 3, 2, 1]  # each chunk's forwards before its first backward, in ZB-V's order
    assert plan.shape == "2:1:1 x2 V"
    plan.save(tmp_path / "p.yaml")
    doc = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert [s["devices"] for s in doc["stages"]] == [[0, 1], [2], [3], [3], [2], [0, 1]]  # the stage list, as ever
    assert Plan.load(tmp_path / "p.yaml") == plan
    for s in doc["stages"]:
        del s["warmup"]  # left out: filled in from the order
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(doc))
    assert Plan.load(tmp_path / "q.yaml").warmup == plan.warmup
    doc["stages"][4]["warmup"] = 4
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(DocumentError, match=r"bad.yaml.stages\[0\].warmup: missing while other stages give one"):
        Plan.load(tmp_path / "bad.yaml")


def test_a_chunk_warmup_other_than_its_orders_is_named():
    with pytest.raises(ValueError, match=r"Plan.stages\[4\].warmup: chunk 1 on devices \[2\] runs K_4 = 2 forwards "
                                         r"before its first backward under zb-v, got 3"):
        Plan(16, 2, [Stage(s.layers, s.devices, k) for s, k in zip(_stages([0, 1, 2, 2, 1, 0]), [6, 5, 4, 3, 3, 1])],
             schedule="zb-v")


@pytest.mark.parametrize("order, schedule, message", [
    ([0, 1, 2, 0, 1, 2], "zb-v", r"Plan.schedule: 'zb-v' runs chunks in the V order, but the stages are 2 chunks per "
                                 r"device group in the loop order \(stages \[0, 3\] on devices \[0, 1\]\); use "
                                 r"'interleaved-1f1b'"),
    ([0, 1, 2, 2, 1, 0], "interleaved-1f1b", r"'interleaved-1f1b' runs chunks in the loop order.*use 'zb-v'"),
    ([0, 1, 2, 2, 1, 0], "dapple", r"Plan.schedule: 'dapple' runs one stage per device group, but the stages are 2 "
                                   r"chunks.*use 'zb-v'"),
    ([0, 1, 2], "zb-v", r"Plan.schedule: 'zb-v' runs several chunks per device group .* use one of \('dapple', "
                        r"'gpipe', 'zb-h1'\)"),
])
def test_a_schedule_that_cannot_run_the_chunks_is_named(order, schedule, message):
    with pytest.raises(ValueError, match=message):
        Plan(16, 2, _stages(order), schedule=schedule)


def test_stage_of_device_refuses_a_device_of_several_chunks():
    plan = Plan(8, 2, _stages([0, 1, 2, 0, 1, 2]), schedule="interleaved-1f1b")
    assert plan.stages_of_device(3) == [2, 5]
    with pytest.raises(ValueError, match=r"device 3 holds 2 stages \(chunks \[2, 5\]\): use Plan.stages_of_device"):
        plan.stage_of_device(3)
    assert Plan(8, 2, _stages([0, 1, 2])).stage_of_device(3) == 2


def test_print_plan_shows_the_chunks():
    text = str(Plan(16, 2, _stages([0, 1, 2, 0, 1, 2]), schedule="interleaved-1f1b"))
    head, columns, _, *rows = text.splitlines()
    assert head.startswith("dapple plan: 6 stage(s) as 2 chunks on each of 3 device group(s), loop order, on 4 "
                           "device(s)")
    assert columns.split()[:5] == ["stage", "layers", "devices", "chunk", "K_i"]
    assert ["0 of 2" in r for r in rows[:6]] == [True] * 3 + [False] * 3
    assert ["1 of 2" in r for r in rows[:6]] == [False] * 3 + [True] * 3
    assert "chunk" not in str(Plan(16, 2, _stages([0, 1, 2])))  # one stage per group: the table as before
