"""Communication programs: every channel matches pairwise and no plan shape can deadlock (dry run), with one stage
per rank or several chunks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapple.core.chunk_schedule import PLACEMENT_OF
from dapple.core.chunks import group_order
from dapple.core.schedule import pipeline_stage_ops
from dapple.planner import Plan, Stage
from dapple.runtime.program import (
    LOOKAHEAD,
    BoundaryLayout,
    CommError,
    dry_run,
    format_program,
    forward_program,
    rank_program,
    receive_lookahead,
)


@st.composite
def plans(draw):
    """Random stage counts, replica counts, micro-batch counts, non-increasing K_i, schedules, value layouts."""
    num_stages = draw(st.integers(1, 4))
    replicas = [draw(st.integers(1, 3)) for _ in range(num_stages)]
    mbs = draw(st.integers(max(replicas), 7))
    m = draw(st.integers(1, 7))
    warmup, k = [], m + 1
    for _ in range(num_stages):
        k = draw(st.integers(1, max(1, min(k, m + 1))))
        warmup.append(k)
    devices, start = [], 0
    for r in replicas:
        devices.append(list(range(start, start + r)))
        start += r
    schedule = draw(st.sampled_from(["dapple", "gpipe", "zb-h1"]))
    plan = Plan(global_batch_size=mbs * m, micro_batch_size=mbs, schedule=schedule,
                stages=[Stage((i, i + 1), d, w) for i, (d, w) in enumerate(zip(devices, warmup))])
    values = tuple(draw(st.integers(1, 3)) for _ in range(num_stages - 1))
    grads = tuple(tuple(v for v in range(n) if draw(st.booleans())) for n in values)
    whole = tuple(tuple(v for v in range(n) if draw(st.booleans())) for n in values)  # sent whole (no batch rows)
    return plan, BoundaryLayout(values=values, grads=grads, whole=whole)


@settings(max_examples=300, deadline=None)
@given(plans(), st.sampled_from([LOOKAHEAD, 0]))
def test_programs_match_pairwise_and_never_deadlock(case, lookahead):
    plan, layout = case
    programs = {r: rank_program(plan, layout, r, lookahead) for r in range(plan.num_devices)}
    dry_run(plan, layout, programs)  # raises CommError on a mismatch or a deadlock
    for r, prog in programs.items():  # computations follow the schedule exactly
        s = plan.stage_of_device(r)
        assert [i.op for i in prog if i.action == "compute"] == pipeline_stage_ops(
            plan.schedule, plan.num_micro_batches, plan.warmup, s)
        comp_pos = {i.op: k for k, i in enumerate(prog) if i.action == "compute"}
        for k, i in enumerate(prog):  # every receive is posted before the computation that needs it
            if i.action == "recv":
                t = i.transfer
                op = ("F" if t.kind == "act" else "B", t.micro_batch)
                assert k < comp_pos[op]
    # every micro-batch's rows cross each cut exactly once, per value (split-concat covers the slice); a value sent
    # whole reaches each receiver once, its gradient goes back on the same route
    rows, whole, back = Counter(), Counter(), Counter()
    for prog in programs.values():
        for i in prog:
            t = i.transfer
            if i.action != "send":
                continue
            if t.value in layout.whole[t.cut]:
                (whole if t.kind == "act" else back)[(t.cut, t.micro_batch, t.value, t.dst if t.kind == "act"
                                                      else t.src)] += 1
            elif t.kind == "act":
                rows[(t.cut, t.micro_batch, t.value)] += t.rows
    assert set(rows.values()) <= {plan.micro_batch_size}
    split = sum(n - len(w) for n, w in zip(layout.values, layout.whole))
    assert len(rows) == split * plan.num_micro_batches
    receivers = sum(len(w) * plan.stages[c + 1].replicas for c, w in enumerate(layout.whole))
    assert set(whole.values()) <= {1} and len(whole) == receivers * plan.num_micro_batches
    assert set(back) == {k for k in whole if k[2] in layout.grads[k[0]]} and set(back.values()) <= {1}


@settings(max_examples=100, deadline=None)
@given(plans(), st.integers(1, 5), st.sampled_from([LOOKAHEAD, 0]))
def test_forward_only_programs_match_pairwise_and_never_deadlock(case, micro_batches, lookahead):
    """eval_step's programs: each micro-batch's forward in order, activations only, any number of micro-batches."""
    plan, layout = case
    programs = {r: forward_program(plan, layout, r, micro_batches, lookahead) for r in range(plan.num_devices)}
    dry_run(plan, layout, programs)
    for prog in programs.values():
        assert [str(i.op) for i in prog if i.action == "compute"] == [f"F{j}" for j in range(micro_batches)]
        assert all(i.transfer.kind == "act" for i in prog if i.action != "compute")


def _plan(warmup, schedule="dapple"):
    return Plan(global_batch_size=8, micro_batch_size=2, schedule=schedule,
                stages=[Stage((0, 1), [0], warmup[0]), Stage((1, 2), [1, 2], warmup[1])])


def test_dry_run_finds_the_deadlock_of_an_increasing_warmup():
    plan = _plan([1, 1])
    plan.stages[1].warmup = 3  # bypasses Plan validation: stage 1 waits for 3 forwards, stage 0 sends 1
    # stage 1's replicas wait for a 2nd forward before their first backward; stage 0 waits for that backward
    with pytest.raises(CommError, match=r"deadlock: .* \{0: 'compute B0', 1: 'compute F1', 2: 'compute F1'\}"):
        dry_run(plan, BoundaryLayout(values=(1,), grads=((0,),)))


def test_dry_run_finds_mismatched_order():
    plan, layout = _plan([2, 1]), BoundaryLayout(values=(2,), grads=((0, 1),))
    programs = {r: rank_program(plan, layout, r) for r in range(3)}
    recvs = [k for k, i in enumerate(programs[1]) if i.action == "recv"]
    a, b = recvs[0], recvs[1]  # two values of the same micro-batch swapped at the receiver
    programs[1][a], programs[1][b] = programs[1][b], programs[1][a]
    with pytest.raises(CommError, match=r"channel 0->1 \(act\): message 0"):
        dry_run(plan, layout, programs)


def test_receives_are_posted_one_op_ahead():
    plan = _plan([2, 1])
    prog = rank_program(plan, BoundaryLayout(values=(1,), grads=((0,),)), 1)  # stage 1, replica 0, K=1
    text = [str(i.op) if i.action == "compute" else f"{i.action}-{i.transfer.kind}{i.transfer.micro_batch}"
            for i in prog]
    # the next op's activations are posted before the current op runs; B0's gradient is sent right after B0
    assert text[:9] == ["recv-act0", "F0", "recv-act1", "B0", "send-grad0", "F1", "recv-act2", "B1", "send-grad1"]


def test_receives_are_posted_just_in_time_on_cuda():
    """A posted NCCL receive spins on the GPU until its data comes: on CUDA nothing of the rank's own runs
    between posting a receive and waiting on it (measured: stage 0's first forward hung behind the receive of
    micro-batch 0's gradients on an H100)."""
    assert receive_lookahead(torch.device("cuda", 0)) == 0 and receive_lookahead(torch.device("cpu")) == LOOKAHEAD
    plan = _plan([2, 1])
    prog = rank_program(plan, BoundaryLayout(values=(1,), grads=((0,),)), 0, receive_lookahead(torch.device("cuda")))
    text = [str(i.op) if i.action == "compute" else f"{i.action}-{i.transfer.kind}{i.transfer.micro_batch}"
            for i in prog]
    # stage 0 (K=2, two replicas downstream): every receive comes right before the op that waits on it
    assert text[:9] == ["F0", "send-act0", "send-act0", "F1", "send-act1", "send-act1", "recv-grad0", "recv-grad0",
                        "B0"], text
    for k, i in enumerate(prog):  # after a receive, only receives until the computation that waits on them
        if i.action == "recv":
            assert next(j for j in prog[k:] if j.action != "recv").action == "compute", text


def test_zb_h1_program_moves_nothing_for_w_and_prints():
    plan = _plan([2, 1], schedule="zb-h1")
    layout = BoundaryLayout(values=(1,), grads=((0,),))
    programs = {r: rank_program(plan, layout, r) for r in range(3)}
    dry_run(plan, layout, programs)
    text = format_program(programs[1]).splitlines()  # stage 1, replica 0 (rows 0:1): K=1, W deferred up to K_0=2
    assert [x for x in text if not x.startswith(" ")] == ["F0", "B0", "F1", "B1", "W0", "F2", "B2", "W1", "F3", "B3",
                                                          "W2", "W3"]
    assert text[:6] == ["  recv act0 v0 0->1 rows 0:1", "F0", "  recv act1 v0 0->1 rows 0:1", "B0",
                        "  send grad0 v0 1->0 rows 0:1", "F1"]
    w = [k for k, x in enumerate(text) if x.startswith("W")]
    assert all(not x.startswith("  send") for k in w for x in text[k + 1:k + 2])  # a W sends nothing


@st.composite
def chunked_plans(draw):
    """Random device groups (1 to 3 replicas each) holding 2 or 3 chunks in the loop or V order, micro-batch counts,
    value layouts: plans whose ranks run several stages."""
    groups = draw(st.integers(1, 4))
    schedule = draw(st.sampled_from(["interleaved-1f1b", "zb-v"]))
    chunks = 2 if schedule == "zb-v" else draw(st.integers(2, 3))
    replicas = [draw(st.integers(1, 3)) for _ in range(groups)]
    devices, start = [], 0
    for r in replicas:
        devices.append(list(range(start, start + r)))
        start += r
    order = group_order(groups, chunks, PLACEMENT_OF[schedule])
    mbs = draw(st.integers(max(replicas), 6))
    m = draw(st.integers(1, 8))
    plan = Plan(global_batch_size=mbs * m, micro_batch_size=mbs, schedule=schedule,
                stages=[Stage((i, i + 1), devices[g]) for i, g in enumerate(order)])
    cuts = plan.num_stages - 1
    values = tuple(draw(st.integers(1, 3)) for _ in range(cuts))
    grads = tuple(tuple(v for v in range(n) if draw(st.booleans())) for n in values)
    whole = tuple(tuple(v for v in range(n) if draw(st.booleans())) for n in values)
    return plan, BoundaryLayout(values=values, grads=grads, whole=whole)


@settings(max_examples=300, deadline=None)
@given(chunked_plans(), st.sampled_from([LOOKAHEAD, 0]))
def test_chunked_programs_match_pairwise_and_never_deadlock(case, lookahead):
    """Several chunks per rank: every channel matches and no rank waits forever, hand-offs between a rank's own
    chunks included (each made before the op that takes it); the ops are the plan's order."""
    plan, layout = case
    programs = {r: rank_program(plan, layout, r, lookahead) for r in range(plan.num_devices)}
    dry_run(plan, layout, programs)
    chunks = plan.chunks
    for r, prog in programs.items():
        assert [i.op for i in prog if i.action == "compute"] == plan.rank_ops(r)
        for i in prog:
            if i.action != "compute":  # a hand-off stays on the rank exactly where both chunks are the rank's
                t = i.transfer
                assert t.local == chunks.same_group(t.cut, t.cut + 1), (r, t)
    rows = Counter()
    for prog in programs.values():
        for i in prog:
            t = i.transfer
            if i.action == "send" and t.kind == "act" and t.value not in layout.whole[t.cut]:
                rows[(t.cut, t.micro_batch, t.value)] += t.rows
    split = sum(n - len(w) for n, w in zip(layout.values, layout.whole))
    assert set(rows.values()) <= {plan.micro_batch_size} and len(rows) == split * plan.num_micro_batches
    forwards = {r: forward_program(plan, layout, r, 3, lookahead) for r in range(plan.num_devices)}
    dry_run(plan, layout, forwards)


def test_a_hand_off_needed_before_it_is_made_is_a_deadlock():
    """A rank's chunks wait on each other too: a V's middle group taking its up chunk's forward before its down chunk
    made it cannot finish."""
    plan = Plan(4, 1, [Stage((i, i + 1), [g]) for i, g in enumerate([0, 1, 1, 0])], schedule="zb-v")
    layout = BoundaryLayout(values=(1, 1, 1), grads=((0,), (0,), (0,)))
    programs = {r: rank_program(plan, layout, r) for r in range(2)}
    compute = [k for k, i in enumerate(programs[1]) if i.action == "compute"]
    first, second = compute[0], compute[1]  # F0@s1, then F0@s2 (which takes F0@s1's hand-off)
    assert (str(programs[1][first].op), str(programs[1][second].op)) == ("F0@s1", "F0@s2")
    programs[1][first], programs[1][second] = programs[1][second], programs[1][first]
    with pytest.raises(CommError, match=r"deadlock: .*1: 'compute F0@s2'"):
        dry_run(plan, layout, programs)


@pytest.mark.parametrize("chunks", [2, 3])
def test_interleaved_orders_never_deadlock_however_many_groups(chunks):
    """Every M up to 3P + 1 on up to 8 groups, where P does not divide M too (Megatron's short last round deadlocked
    at P = 5, M = 7: 'every unfinished rank waits on a receive nobody will send')."""
    for groups in range(1, 9):
        layout = BoundaryLayout(values=(1,) * (chunks * groups - 1), grads=((0,),) * (chunks * groups - 1))
        for m in range(1, 3 * groups + 2):
            plan = Plan(m, 1, [Stage((i, i + 1), [i % groups]) for i in range(chunks * groups)],
                        schedule="interleaved-1f1b")
            dry_run(plan, layout)
