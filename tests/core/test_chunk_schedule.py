"""The op orders of chunked device groups: interleaved 1F1B and ZB-V, as torch.distributed.pipelining builds them,
every micro-batch's ops once per chunk, and what a group holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dapple.core.chunk_schedule import (
    ChunkOp,
    chunk_warmups,
    forward_order,
    interleaved_ops,
    peak_held,
    rank_ops,
    round_sizes,
    zbv_ops,
)

KINDS = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}


def _pippy(actions) -> list[tuple]:
    return [(KINDS[a.computation_type.name], a.microbatch_index, a.stage_index) for a in actions if a is not None]


@pytest.mark.parametrize("groups", [1, 2, 3, 4, 5])
def test_zbv_is_torch_pipelinings_order(groups):
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
    for m in range(1, 13):
        for g in range(groups):
            fake = SimpleNamespace(pp_group_size=groups, _n_microbatches=m, num_stages=2 * groups)
            assert [tuple(op) for op in zbv_ops(m, groups, g)] == _pippy(
                ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, g)), (m, g)


@pytest.mark.parametrize("groups, chunks", [(1, 2), (2, 2), (4, 2), (2, 3), (3, 3), (4, 4), (5, 2)])
def test_interleaved_is_torch_pipelinings_order(groups, chunks):
    """Megatron's order in torch.distributed.pipelining's rounds: ScheduleInterleaved1F1B makes the same for every M
    it accepts (rounds of M // (M // P) micro-batches that divide M)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
    for m in range(1, 4 * groups + 2):
        rounds = max(1, m // groups)
        if m % rounds:
            continue  # torch refuses it: uneven rounds
        for g in range(groups):
            fake = SimpleNamespace(pp_group_size=groups, _n_microbatches=m, n_local_stages=chunks,
                                   microbatches_per_round=m // rounds)
            assert [tuple(op) for op in interleaved_ops(m, groups, chunks, g)] == _pippy(
                ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, g)), (m, g)


def test_rounds_hold_at_least_p_micro_batches():
    """Megatron's rounds of P with a short last one deadlock (P = 5, M = 7: tests/runtime/test_program.py); rounds of
    M // (M // P), the larger first, do not."""
    assert round_sizes(7, 5) == [7] and round_sizes(13, 5) == [7, 6] and round_sizes(12, 4) == [4, 4, 4]
    assert round_sizes(3, 5) == [3]
    assert forward_order(5, 2, 2) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]


@pytest.mark.parametrize("schedule, groups, chunks", [("interleaved-1f1b", 3, 2), ("interleaved-1f1b", 2, 3),
                                                      ("zb-v", 3, 2), ("zb-v", 1, 2)])
def test_every_chunk_runs_each_micro_batch_once_forward_before_backward(schedule, groups, chunks):
    for m in range(1, 9):
        for g in range(groups):
            ops = rank_ops(schedule, m, groups, chunks, g)
            kinds = "FBW" if schedule == "zb-v" else "FB"
            stages = {op.stage for op in ops}
            assert len(stages) == chunks and len(ops) == len(stages) * m * len(kinds)
            for s in stages:
                for j in range(m):
                    at = [ops.index(ChunkOp(k, j, s)) for k in kinds]
                    assert at == sorted(at), (m, g, s, j)


def test_warmups_and_what_a_group_holds():
    ops = interleaved_ops(8, 4, 2, 0)  # group 0 of 4: 4 + 6 forwards first
    assert chunk_warmups(ops) == {0: 8, 4: 4}
    assert peak_held(ops) == 11  # chunk-micro-batches alive at once: 10 forwards, then one more before a backward
    assert peak_held(ops, {0: 2.0, 4: 1.0}.get) == 8 * 2 + 3  # weighted by each chunk's bytes: at F7@s0
    last = zbv_ops(8, 4, 3)
    assert chunk_warmups(last) == {3: 5, 4: 4}
    assert str(last[0]) == "F0@s3" and last[0].op == ("F", 0)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"zb-v runs two chunks per device group \(the V\), got 3"):
        rank_ops("zb-v", 4, 2, 3, 0)
    with pytest.raises(ValueError, match=r"group: expected 0..1, got 2"):
        rank_ops("zb-v", 4, 2, 2, 2)
    with pytest.raises(ValueError, match=r"schedule: expected one of \('interleaved-1f1b', 'zb-v'\), got 'dapple'"):
        rank_ops("dapple", 4, 2, 2, 0)
