"""Real architectures as they come: transformers' GPT-2, BERT and Llama (tiny configs, unwrapped, ModelOutput and
all), a CNN with BatchNorm and a model whose blocks only run as fx leaf modules, pipelined on 4 ranks (1 -> 2 -> 1
replicas) in float64: loss and gradients of two steps (the second at another sequence length), evaluation, and
state equal single-process runs."""

from __future__ import annotations

import pytest

from tests.conftest import needs_export
from tests.runtime._spawn import run_ranks

pytest.importorskip("transformers")
pytestmark = [needs_export, pytest.mark.slow]

TOL = 1e-9
MODELS = ["gpt2", "bert", "llama", "cnn", "leaf"]


@pytest.fixture(scope="module")
def results():
    from tests.hf import workers
    return run_ranks(workers.run_all, 4, timeout=400)


@pytest.mark.parametrize("model", MODELS)
def test_steps_equal_single_process_training(results, model):
    for rank, r in enumerate(res[model] for res in results):
        for step, s in enumerate(r["steps"]):
            assert s["loss"][1] <= TOL, (model, rank, step, s["loss"])
            bad = {n: e for n, e in s["grads"].items() if not e[1] <= TOL}
            assert not bad, (model, rank, step, bad)
    names = [set(res[model]["steps"][0]["grads"]) for res in results]  # every parameter checked, replicas alike
    assert names[1] == names[2] and set().union(*names) == set(results[0][model]["params"])


@pytest.mark.parametrize("model", MODELS)
def test_eval_step_is_the_eval_mode_loss_on_every_rank(results, model):
    for rank, r in enumerate(res[model]["eval"] for res in results):
        assert r["loss"][1] <= TOL and r["eval_again"] <= TOL and r["no_grad"], (model, rank, r)
        last = rank == 3
        assert r["rows"] == (list(range(12)) if last else []), (model, rank)
        assert all(e <= TOL for e in r["outputs"]), (model, rank, r["outputs"])
    train_losses = {res[model]["eval"]["train_mode"][0] for res in results}
    assert len(train_losses) == 1  # the same on every rank
    error = results[0][model]["eval"]["train_mode"][1]
    if model == "bert":  # dropout 0.1, on in train mode: not the evaluation's loss
        assert error > 1e-6
    else:  # the train-mode forward (BatchNorm: batch statistics, and one update of the running ones)
        assert error <= TOL


@pytest.mark.parametrize("model", MODELS)
def test_state_dict_has_the_models_keys_and_values(results, model):
    keys = [res[model]["state"]["keys"] for res in results]
    all_keys = results[0][model]["state"]["all_keys"]
    assert keys[1] == keys[2]  # replicas
    assert sorted(set().union(*map(set, keys))) == sorted(all_keys)  # every key, persistent buffers only
    for rank, res in enumerate(results):
        st = res[model]["state"]
        assert all(e <= TOL for e in st["errors"].values()), (model, rank, st["errors"])
        assert st["counts"] == st["ref_counts"], (model, rank)
        missing, unexpected, moved = st["loaded"]
        assert missing == [] and unexpected == [] and moved, (model, rank)
