"""Per-rank function for the autotuner tests: emulated layers on 4 ranks, a slowdown injected mid-run, a forced bad
switch; float64, every loss against one process."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.nn.functional as F

import dapple
from dapple.models import EmulatedNet
from dapple.planner import Stage
from dapple.profiler import LayerProfile

MS = 1.5  # forward ms per row of every emulated layer (backward 2x)
LAYERS, WIDTH, GBS = 6, 8, 8
FACTOR = 3.0
EVERY = 4


def profile() -> dapple.Profile:
    """What the emulated layers cost (ms per row x rows; float64 activations), as a profiler would have found."""
    def layer(name: str, ms: float, params: int) -> LayerProfile:
        return LayerProfile(name, [ms, 2 * ms], [2 * ms, 4 * ms], [WIDTH * 8, 2 * WIDTH * 8],
                            [2 * WIDTH * 8, 4 * WIDTH * 8], params)
    layers = [layer(f"layers.{i}", MS, (WIDTH + 1) * WIDTH * 8) for i in range(LAYERS)]
    return dapple.Profile("emulated", "cpu", [1, 2], layers + [layer("head", 0.02, (WIDTH + 1) * 4 * 8)])


def cluster() -> dapple.Cluster:
    return dapple.Cluster.local(4, bandwidth=1e9, latency=2e-4, measure=False)


OPTIONS = {"micro_batch_size": 1}  # one row per micro-batch: no stage can be replicated, plans are pipelines
BAD = [((0, 4), [0]), ((4, 5), [1]), ((5, 6), [2]), ((6, 7), [3])]  # four layers on rank 0


def first_plan() -> dapple.Plan:
    """The planner's plan for the profile (straight, M = 8)."""
    return dapple.plan(profile(), cluster(), GBS, workers=1, **OPTIONS)


def _plan(stages, micro: int = 1) -> dapple.Plan:
    est = dapple.evaluate(profile(), cluster(), [(a, c, d) for (a, c), d in stages], GBS, micro, model="refined")
    return dapple.Plan(GBS, micro, [Stage(layers, d, k["warmup"]) for (layers, d), k in
                                    zip(stages, est.details["stages"])], layer_names=profile().layer_names)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(GBS, WIDTH, generator=g, dtype=torch.float64), torch.randint(0, 4, (GBS,), generator=g)


def run() -> dict[str, Any]:
    """Window 1: as profiled; then layers 2 and 3 slowed down 3x on every rank; windows 2-3 as the tuner decides;
    window 4 ends in a forced switch to a bad plan, window 5 measures it."""
    torch.manual_seed(0)
    model = EmulatedNet([MS] * LAYERS, width=WIDTH).double()
    reference = copy.deepcopy(model)
    first = first_plan()
    slow = range(*next(s.layers for s in first.stages if s.layers[1] - s.layers[0] == 2 and s.layers[1] < LAYERS))
    pipe = dapple.pipeline(model, first, F.cross_entropy, timeout=60)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    tuner = dapple.Autotuner(pipe, profile(), cluster(), optimizer=opt, every=EVERY, margin=0.1,
                                     plan_options=OPTIONS)
    losses, plans = [], [[(s.layers, s.devices) for s in first.stages]]
    for step in range(5 * EVERY):
        if step == EVERY:  # the layers of one stage get slower, wherever they run (their buffers move with them)
            for name, buf in pipe.module.named_buffers():
                if name in {f"layers.{i}.slowdown" for i in slow}:
                    buf.fill_(FACTOR)
        if step == 4 * EVERY - 1:
            tuner.trial(_plan(BAD))
        losses.append(pipe.train_step(*_batch(step)))
        opt.step()
        opt.zero_grad()
        if tuner.step() is not None:
            plans.append([(s.layers, s.devices) for s in pipe.plan.stages])
    for layer in reference.layers:  # one process, eager: no holds needed
        layer.ms_per_row = 0.0
    ref_opt, ref = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9), []
    for step in range(5 * EVERY):
        x, y = _batch(step)
        loss = F.cross_entropy(reference(x), y)
        loss.backward()
        ref.append(float(loss.detach()))
        ref_opt.step()
        ref_opt.zero_grad()
    return {"rank": int(os.environ["RANK"]), "history": tuner.history, "plans": plans, "losses": losses,
            "one_process": ref, "slow": list(slow)}
