"""`dapple demo`: profile, measured local cluster, plan that must split the model, pipelined training."""

from __future__ import annotations

import pytest

from dapple.cli.demo import DemoConfig, make_batch, run


@pytest.mark.slow
def test_demo_plans_a_split_and_the_loss_falls(tmp_path):
    out = run(DemoConfig(nproc=2, steps=12, global_batch=8, seq=16, n_layer=2, n_embd=32, lr=1e-2,
                         trace=str(tmp_path / "demo.json")))
    plan = out["plan"]
    assert plan.num_devices == 2 and plan.num_stages == 2  # capped device memory: the model must be split
    losses = out["losses"]
    assert len(losses) == 12 and losses[-1] < 0.8 * losses[0]
    assert (tmp_path / "demo.json").stat().st_size > 1000


@pytest.mark.slow
def test_demo_on_one_process_plans_the_whole_model_uncapped(capsys):
    """With several processes the cap leaves no single stage room (the default run plans 4 stages on 4); one
    process has nothing to split across, so its memory is not capped and the run still trains."""
    out = run(DemoConfig(nproc=1, steps=3, global_batch=4, seq=8, n_layer=1, n_embd=16))
    assert out["plan"].num_stages == 1 and len(out["losses"]) == 3
    assert "capped" not in capsys.readouterr().out


def test_demo_batches_follow_the_toy_language_and_match_across_calls():
    cfg = DemoConfig(vocab=16, seq=5, global_batch=4)
    x, y = make_batch(cfg, 3)
    assert x.shape == y.shape == (4, 5) and (x[:, 1:] == y[:, :-1]).all()
    assert all(len({int(b) for a, b in zip(x.flatten(), y.flatten()) if int(a) == t}) <= 1 for t in range(16))
    assert (make_batch(cfg, 3)[0] == x).all() and not (make_batch(cfg, 4)[0] == x).all()


def test_demo_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"nproc: expected 1 .. global batch \(32\) processes, got 0"):
        run(DemoConfig(nproc=0))
    with pytest.raises(ValueError, match=r"memory_fraction: expected a positive share .* got -0.5"):
        run(DemoConfig(memory_fraction=-0.5))
