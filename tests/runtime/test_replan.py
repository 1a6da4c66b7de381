"""Pipeline.replan on 4 ranks (gloo, float64): switched A -> B in memory after 3 steps, training goes on exactly as
from a checkpoint of the same state loaded under B, and as one process; a gradient accumulated across a switch;
bad replans raise on every rank and leave the pipeline usable. The routing of keys, in one process."""

from __future__ import annotations

import pytest
import torch

from dapple.runtime.replan import Switch
from dapple.runtime.reshard import BUFFER, PARAMETER, Held, Piece, exchanges, sources
from tests.runtime import replan_workers
from tests.runtime._spawn import run_ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(replan_workers.run, 4, str(tmp_path_factory.mktemp("replan")), timeout=280)


@pytest.mark.slow
def test_the_losses_after_a_switch_are_those_of_a_checkpoint_reloaded_under_the_new_plan(results):
    for r in results:  # every rank returns the loss of each step
        assert r["replanned"] == r["reloaded"]  # bit for bit: the same state, the same plan from step 4
        assert r["replanned"][3:] != r["replanned"][:3]
    state, reloaded = results[0]["state"], results[0]["reloaded_state"]
    assert state.keys() == reloaded.keys() and any(k.endswith("scale") for k in state)  # (offset: not state)
    assert state == reloaded


@pytest.mark.slow
def test_a_switched_run_trains_as_one_process_does(results):
    assert results[0]["replanned"] == pytest.approx(results[0]["one_process"], rel=1e-12, abs=1e-14)
    for r in results:
        assert r["accumulated_error"] < 1e-12


@pytest.mark.slow
def test_tied_parameters_across_stages_switch_and_the_model_given_is_not_held(results):
    for r in results:
        gpt = r["gpt"]
        assert gpt["losses"] == pytest.approx(gpt["one_process"], rel=1e-12, abs=1e-14)
        assert gpt["alive"] == 0  # built from the model's structure: none of its tensors is kept


@pytest.mark.slow
def test_the_optimizer_is_rebuilt_in_place_over_the_new_stage(results):
    after = [r["after_switch"] for r in results]
    assert [a["stage"] for a in after] == [0, 1, 1, 1]
    assert after[0]["params"][0].startswith("blocks.0") and after[1]["params"][-1] == "head.weight"
    for a in after:  # two groups still (the scheduler's lists stay aligned), each with its parameters
        assert len(a["groups"]) == 2 and sum(a["groups"]) == len(a["params"])
        assert a["lr"] == pytest.approx([0.025, 0.025])  # StepLR went on from the same step


@pytest.mark.slow
def test_the_switch_reports_its_cost(results):
    switches: list[Switch] = [r["switch"] for r in results]
    for s in switches:
        assert s.seconds >= s.build_seconds > 0 and s.move_seconds > 0
        assert s.old_plan == "0-2x2 2-4x1 4-7x1 M6 dapple" and s.new_plan == "0-4x1 4-7x3 M4 dapple"
    assert switches[0].kept > 0 and switches[0].received > 0  # blocks 0-1 stay, blocks 2-3 arrive from rank 2
    assert switches[3].kept > 0 and switches[1].kept == 0  # rank 3 keeps the head; rank 1 held blocks 0-1 only
    assert sum(s.sent_bytes for s in switches) == sum(s.received_bytes for s in switches) > 0


@pytest.mark.slow
def test_bad_replans_raise_on_every_rank_and_the_pipeline_goes_on(results):
    for rank, r in enumerate(results):
        assert "the new plan uses 2 devices, the job runs 4 ranks" in r["errors"]["world"]
        msg = r["errors"]["optimizer"]
        assert "ranks [0, 1, 3] passed an optimizer, ranks [2] did not" in msg, (rank, msg)
        assert r["stage_after_errors"] == (0 if rank < 2 else 1 if rank == 2 else 2)  # still plan A
    assert results[0]["usable_after_errors"] == pytest.approx(results[3]["usable_after_errors"])


def _held(kind=PARAMETER, first=True) -> Held:
    return Held(kind, Piece((2,), "float64", True), first_replica=first)


def test_each_key_comes_from_its_holder_itself_first_and_buffers_from_a_first_replica():
    holders = [{"w": _held(), "bn": _held(BUFFER, True)}, {"w": _held(), "bn": _held(BUFFER, False)},
               {"v": _held()}, {"v": _held()}]
    wants = [["v"], ["w", "bn"], ["w", "bn", "v"], ["v"]]
    src = sources(holders, wants)
    assert src[(1, "w")] == 1 and src[(1, "bn")] == 0  # a replica's own buffer may differ: replica 0's
    assert src[(0, "v")] in (2, 3) and src[(3, "v")] == 3
    assert {src[(2, "w")], src[(0, "v")]} <= {0, 1, 2, 3}
    pairs = exchanges(src)
    assert (1, 1) not in pairs and pairs[(0, 1)] == ["bn"] and all(sorted(v) == v for v in pairs.values())
    with pytest.raises(ValueError, match="rank 0 needs 'u'"):
        sources(holders, [["u"], [], [], []])


def test_pieces_travel_in_one_order():
    h = Held(PARAMETER, Piece((3, 2), "float32", True), Piece((3, 2), "float32", True), 0,
             (("exp_avg", Piece((3, 2), "float32", True)), ("step", Piece((), "float32", False))), {"x": 1})
    assert [p.shape for p in h.pieces()] == [(3, 2), (3, 2), (3, 2), ()]
    assert h.pieces()[-1].empty(torch.device("cpu")).dtype == torch.float32
