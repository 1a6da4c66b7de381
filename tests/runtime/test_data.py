"""Per-rank loading in one process: which rows each rank reads (RankData), the sampler and collate built on it,
and the per-rank checks of a batch's layout (errors naming what was expected)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from dapple.planner import Plan, Stage
from dapple.profiler.layers import Arity
from dapple.runtime import DistributedPipelineSampler, RankCollate, pipeline_loader, rank_data
from dapple.runtime.data import CompactRows
from dapple.runtime.rank_batch import rank_batch

# 3 stages: the first on ranks 0, 1 (slices 0:2 and 2:3 of each micro-batch of 3), a middle stage on rank 2, the
# last on ranks 3, 4, 5 (one row each)
PLAN = Plan(global_batch_size=9, micro_batch_size=3,
            stages=[Stage((0, 1), [0, 1]), Stage((1, 2), [2]), Stage((2, 3), [3, 4, 5])])
TWO_INPUTS = ((0,), (2,))  # input 0 read by stage 0, input 1 by the last stage (a head that takes a second input)


def test_a_replica_reads_its_slice_of_every_micro_batch_in_order():
    assert rank_data(PLAN, 0).rows() == [0, 1, 3, 4, 6, 7]
    assert rank_data(PLAN, 1).rows() == [2, 5, 8]
    assert rank_data(PLAN, 2).rows() == [] and not rank_data(PLAN, 2).loads  # the middle stage reads nothing
    assert [rank_data(PLAN, r).rows() for r in (3, 4, 5)] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert rank_data(PLAN, 1).rows(6) == [2, 5]  # an evaluation batch of 2 micro-batches
    assert rank_data(PLAN, 0).row_count(12) == 8


def test_each_input_is_read_by_the_stages_whose_graph_reads_it():
    first, last = rank_data(PLAN, 1, TWO_INPUTS, ["x", "z"]), rank_data(PLAN, 4, TWO_INPUTS, ["x", "z"])
    assert (first.reads, first.targets) == ((True, False), False)
    assert (last.reads, last.targets, last.slice) == ((False, True), True, (1, 2))
    assert rank_data(PLAN, 2, TWO_INPUTS).rows() == []


def test_rank_data_names_bad_arguments():
    with pytest.raises(ValueError, match=r"rank: expected a rank of the plan, 0 to 5, got 6"):
        rank_data(PLAN, 6)
    with pytest.raises(ValueError, match=r"input_stages\[1\]: expected stage indices 0 to 2, got \[3\]"):
        rank_data(PLAN, 0, ((0,), (3,)))
    with pytest.raises(ValueError, match=r"batch_size: expected a positive multiple of plan.micro_batch_size \(3\), "
                                         r"got 7"):
        rank_data(PLAN, 0).rows(7)


def test_compact_rows_are_read_by_global_rows():
    data = rank_data(PLAN, 0)
    full = torch.arange(9)
    compact = CompactRows(full[data.rows()], 3, data.slice)
    assert compact[3:5].tolist() == [3, 4] and compact[6:8].tolist() == [6, 7]
    with pytest.raises(IndexError, match=r"rows 2:3 of the global batch are not in this replica's slice \[0, 2\) of "
                                         r"micro-batch 0"):
        compact[2:3]


def test_the_sampler_splits_each_step_over_the_ranks_that_read_it():
    samplers = [DistributedPipelineSampler(20, rank_data(PLAN, r), shuffle=True, seed=4) for r in range(6)]
    assert [len(s) for s in samplers] == [2] * 6  # 20 // 9 steps; the last 2 rows wait for the next epoch
    steps = [list(s) for s in samplers]
    assert steps[2] == [[], []]  # the middle stage loads nothing
    for step in range(2):
        batch = samplers[0].global_indices(step)  # the same permutation on every rank
        assert all(s.global_indices(step) == batch for s in samplers)
        for stage in ((0, 1), (3, 4, 5)):  # each stage's replicas load the batch once between them
            loaded = sorted(i for r in stage for i in steps[r][step])
            assert loaded == sorted(batch), (step, stage)
        assert steps[1][step] == [batch[r] for r in (2, 5, 8)] == samplers[1].indices(step)
    first = samplers[0].global_indices(0)
    samplers[0].set_epoch(1)
    assert samplers[0].global_indices(0) != first
    ordered = DistributedPipelineSampler(20, rank_data(PLAN, 1), shuffle=False)
    assert list(ordered) == [[2, 5, 8], [11, 14, 17]]


def test_the_sampler_names_bad_arguments():
    with pytest.raises(ValueError, match=r"dataset_len: expected an int of at least batch_size \(9\) rows, got 8"):
        DistributedPipelineSampler(8, rank_data(PLAN, 0))
    with pytest.raises(ValueError, match=r"batch_size: expected a positive multiple .* got 4"):
        DistributedPipelineSampler(20, rank_data(PLAN, 0), batch_size=4)
    with pytest.raises(TypeError, match=r"expected a dapple.Pipeline or a dapple.runtime.RankData .* got Plan"):
        DistributedPipelineSampler(20, PLAN)
    with pytest.raises(IndexError, match=r"step 2: an epoch has 2 steps"):
        DistributedPipelineSampler(20, rank_data(PLAN, 0)).global_indices(2)


def test_collate_keeps_only_the_tensors_a_rank_reads():
    items = [((torch.full((2,), float(i)), torch.full((2,), -float(i))), torch.tensor(i)) for i in range(3)]
    x, y, rows, ids = RankCollate(rank_data(PLAN, 0, TWO_INPUTS))(items)
    assert x[1] is None and x[0].shape == (3, 2) and y is None and rows == 9 and ids is None
    x, y, rows, ids = RankCollate(rank_data(PLAN, 3, TWO_INPUTS), batch_size=6, indexed=True)(
        [(7 + i, item) for i, item in enumerate(items)])  # (dataset index, item), as IndexedDataset gives
    assert x[0] is None and x[1][:, 0].tolist() == [0, -1, -2] and y.tolist() == [0, 1, 2] and rows == 6
    assert ids.tolist() == [7, 8, 9]
    assert RankCollate(rank_data(PLAN, 2, TWO_INPUTS))([]) == (None, None, 9, None)
    x, y, _, _ = RankCollate(rank_data(PLAN, 4))([(None, torch.tensor(1)), (None, torch.tensor(2))])  # labels alone
    assert x is None and y.tolist() == [1, 2]
    with pytest.raises(TypeError, match=r"a dataset item must be a pair \(inputs, targets\), got tuple of 3"):
        RankCollate(rank_data(PLAN, 0))([(1, 2, 3)])


def test_collate_keeps_the_inputs_by_name_a_rank_reads():
    items = [({"ids": torch.full((2,), i), "mask": torch.ones(2)}, torch.tensor(i)) for i in range(3)]
    names = dict(input_stages=((0,), (2,)), input_names=("ids", "mask"))  # ids on stage 0, mask on stage 2
    x, y, _, _ = RankCollate(rank_data(PLAN, 0, **names))(items)
    assert list(x) == ["ids"] and x["ids"][:, 0].tolist() == [0, 1, 2] and y is None
    x, y, _, _ = RankCollate(rank_data(PLAN, 3, **names))(items)
    assert list(x) == ["mask"] and x["mask"].shape == (3, 2) and y.tolist() == [0, 1, 2]
    x, y, _, _ = RankCollate(rank_data(PLAN, 2, input_stages=((0,), (0,)), input_names=("ids", "mask")))(items)
    assert x is None and y is None  # a middle stage reads nothing


def test_a_loader_reads_only_this_ranks_rows():
    reads: list[int] = []

    class Counting(TensorDataset):
        def __getitem__(self, i):
            reads.append(i)
            return super().__getitem__(i)

    data = Counting(torch.arange(18.0).unsqueeze(1), torch.arange(18))
    loader = pipeline_loader(data, rank_data(PLAN, 4), shuffle=False)
    batches = list(loader)
    assert sorted(reads) == [1, 4, 7, 10, 13, 16]
    assert [(x, y.tolist(), rows, ids.tolist()) for x, y, rows, ids in batches] == [
        (None, [1, 4, 7], 9, [1, 4, 7]), (None, [10, 13, 16], 9, [10, 13, 16])]
    middle = list(pipeline_loader(data, rank_data(PLAN, 2), num_workers=2))  # no row, no worker
    assert [(x, y, rows, ids.tolist()) for x, y, rows, ids in middle] == [(None, None, 9, [])] * 2


ARITY = Arity(["x", "z"], 2, [])


def test_a_rank_may_pass_its_own_rows_the_global_batch_or_none():
    data = rank_data(PLAN, 1, TWO_INPUTS, ["x", "z"])  # reads x, rows 2, 5, 8
    got = rank_batch(data, ARITY, (torch.zeros(3, 4), None), None)
    assert got.inputs[0].compact and got.inputs[1] is None and got.targets is None and got.rows == 9
    got = rank_batch(data, ARITY, (torch.zeros(9, 4), torch.zeros(9, 4)), torch.zeros(9))
    assert not got.inputs[0].compact and not got.targets[0].compact
    middle = rank_batch(rank_data(PLAN, 2, TWO_INPUTS, ["x", "z"]), ARITY, None, None)
    assert middle.inputs is None and middle.targets is None
    # an evaluation: without batch_size a tensor is the whole batch; with it, 1 row per micro-batch is this rank's
    assert rank_batch(data, ARITY, (torch.zeros(3, 4), None), None, any_rows=True).rows == 3
    assert rank_batch(data, ARITY, (torch.zeros(3, 4), None), None, 9, any_rows=True).inputs[0].compact


def test_inputs_by_name_are_the_traced_models_inputs_in_order():
    data = rank_data(PLAN, 1, TWO_INPUTS, ["x", "z"])  # reads x (its own rows: 3)
    got = rank_batch(data, ARITY, {"x": torch.zeros(3, 4)}, None)
    assert got.inputs[0].compact and len(got.inputs) == 1
    got = rank_batch(data, ARITY, {"z": torch.zeros(9, 4), "x": torch.zeros(9, 4)}, None)
    assert [h.tensor.shape for h in got.inputs] == [(9, 4), (9, 4)]
    assert rank_batch(rank_data(PLAN, 2, TWO_INPUTS, ["x", "z"]), ARITY, {}, None).inputs is None  # reads none
    with pytest.raises(ValueError, match=r"inputs\['x'\] has shape \(5, 4\); expected the global batch of 9 rows"):
        rank_batch(data, ARITY, {"x": torch.zeros(5, 4)}, None)
    with pytest.raises(ValueError, match=r"inputs has no 'x', but rank 1 \(stage 0\) reads input 0 \('x'\)"):
        rank_batch(data, ARITY, {"z": torch.zeros(9, 4)}, None)
    with pytest.raises(ValueError, match=r"inputs: \['mask'\] are not inputs of the traced model, which takes "
                                         r"\['x', 'z'\]"):
        rank_batch(data, ARITY, {"x": torch.zeros(9, 4), "mask": torch.zeros(9, 4)}, None)


def test_wrong_per_rank_shapes_name_both_layouts():
    data = rank_data(PLAN, 0, TWO_INPUTS, ["x", "z"])  # reads x, rows 0:2 of each micro-batch: 6 rows
    with pytest.raises(ValueError, match=r"inputs\[0\] has shape \(5, 4\); expected the global batch of 9 rows "
                                         r"\(plan.global_batch_size\) in dimension 0, split into 3 micro-batches of "
                                         r"3, or this rank's own 6 rows \(pipe.rows\(\): rows 0:2 of each "
                                         r"micro-batch, in order\)"):
        rank_batch(data, ARITY, (torch.zeros(5, 4), None), None)
    with pytest.raises(ValueError, match=r"inputs\[0\] is None, but rank 0 \(stage 0\) reads input 0 \('x'\)"):
        rank_batch(data, ARITY, (None, torch.zeros(9, 4)), None)
    last = rank_data(PLAN, 5, TWO_INPUTS, ["x", "z"])
    with pytest.raises(ValueError, match=r"targets is None, but rank 5 \(stage 2\) is on the last stage"):
        rank_batch(last, ARITY, (None, torch.zeros(3, 4)), None)
    with pytest.raises(TypeError, match=r"targets\[0\]: expected a tensor, got NoneType \(pass targets=None"):
        rank_batch(last, ARITY, (None, torch.zeros(3, 4)), [None])
    got = rank_batch(data, ARITY, (torch.zeros(6, 4), None), None, ids=[5, 6, 7, 8, 9, 10])
    assert got.ids.compact and got.ids.tensor.dtype == torch.int64
    assert rank_batch(data, ARITY, (torch.zeros(9, 4), None), None, ids=torch.arange(9)).ids.compact is False
    assert rank_batch(rank_data(PLAN, 2), Arity(["x"], 1, []), None, None, ids=[]).ids is None  # holds nothing
    with pytest.raises(ValueError, match=r"ids has shape \(4,\); expected the global batch of 9 rows .* or this "
                                         r"rank's own 6 rows"):
        rank_batch(data, ARITY, (torch.zeros(6, 4), None), None, ids=[1, 2, 3, 4])
    with pytest.raises(TypeError, match=r"ids: expected a 1-D tensor or sequence of ints .* got Tensor of "
                                        r"torch.float32 \(6,\)"):
        rank_batch(data, ARITY, (torch.zeros(6, 4), None), None, ids=torch.zeros(6))
    with pytest.raises(ValueError, match=r"batch_size: a training step runs the plan's global batch of 9 rows "
                                         r"\(plan.global_batch_size\), got 6"):
        rank_batch(data, ARITY, (torch.zeros(4, 4), None), None, 6)
    with pytest.raises(ValueError, match=r"the model takes 2 inputs \['x', 'z'\], got 1"):
        rank_batch(last, ARITY, torch.zeros(3, 4), torch.zeros(3))  # z is the second input: a tuple with None
