"""Transparency on seeded random plan shapes (gloo, float64): any split, replica counts, device order, micro-batch
size, M, schedule and K_i give the loss and gradients of single-process training."""

from __future__ import annotations

import os
import random

import pytest

from tests.runtime import workers
from tests.runtime._spawn import run_ranks

TOL = 1e-9
CASES = int(os.environ.get("DAPPLE_RANDOM_PLANS", "16"))  # per world; a longer hunt: DAPPLE_RANDOM_PLANS=200
SEED = int(os.environ.get("DAPPLE_RANDOM_SEED", "0"))
# case function, layers of its model (Chain: blocks.0-3, head; Skip: l0, l1, l2, head; GPT: wte, wpe, drop,
# blocks.0, blocks.1, ln_f, lm_head, the head tied to wte; TwoInputs: a, b, head)
MODELS = {"chain": (workers.case_chain, 5), "skip": (workers.case_skip, 4), "gpt": (workers.case_gpt, 7),
          "two_inputs": (workers.case_two_inputs, 3)}


def random_plan(rng: random.Random, world: int, layers: int, options: bool) -> tuple[tuple, dict]:
    """(stages, global batch, micro-batch) using every rank, devices in a random order; with ``options`` a
    random schedule, warmup policy or explicit K_i (non-increasing, as a valid plan needs)."""
    S = rng.randint(1, min(world, layers))
    bounds = [0, *sorted(rng.sample(range(1, layers), S - 1)), layers]
    sizes = [1] * S
    for _ in range(world - S):
        sizes[rng.randrange(S)] += 1
    ranks = rng.sample(range(world), world)
    starts = [sum(sizes[:i]) for i in range(S)]
    stages = [[(bounds[i], bounds[i + 1]), ranks[starts[i]:starts[i] + sizes[i]]] for i in range(S)]
    mbs, M = rng.randint(max(sizes), 7), rng.randint(1, 5)
    kw: dict = {}
    pick = rng.random() if options else 1.0
    if pick < 0.25:
        kw["schedule"] = "gpipe"
    elif pick < 0.5:
        kw["warmup_policy"] = "B"
    elif pick < 0.75:
        for st, k in zip(stages, sorted((rng.randint(1, M) for _ in stages), reverse=True)):
            st.append(k)
    return ([tuple(st) for st in stages], mbs * M, mbs), kw


def cases(seed: int, world: int, n: int) -> dict:
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        name = rng.choice(sorted(MODELS))
        fn, layers = MODELS[name]
        args, kw = random_plan(rng, world, layers, options=name == "chain")  # the others take no options
        out[f"{name}_{i}"] = (fn, args, kw)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world, seed", [(2, 2), (3, 0), (4, 1)])
def test_random_plans_equal_single_process(world, seed):
    todo = cases(SEED + seed, world, CASES if world > 2 else CASES // 2)
    results = run_ranks(workers.run_cases, world, todo, timeout=240 + 10 * CASES)
    for name, (_, args, kw) in todo.items():
        # a rank may hold no parameters (a stage of GPT's dropout alone): its loss still counts
        worst = max(max([step["loss"], *step["grads"].values()]) for r in results for step in r[name])
        assert worst <= TOL, (name, args, kw, worst)
        for step in range(len(results[0][name])):  # every parameter is checked on some rank
            seen = set().union(*(r[name][step]["grads"] for r in results))
            assert seen == set(results[0][name][step]["expected"]), (name, args)


@pytest.mark.slow
@pytest.mark.parametrize("world, seed", [(3, 5), (4, 6)])
def test_random_plans_equal_single_process_under_zero_bubble(world, seed):
    """The same hunt on zb-h1 (plans that name gpipe keep it): B and W split on any shape."""
    todo = workers.with_schedule(cases(SEED + seed, world, CASES), "zb-h1")
    results = run_ranks(workers.run_cases, world, todo, timeout=240 + 10 * CASES)
    for name, (_, args, kw) in todo.items():
        worst = max(max([step["loss"], *step["grads"].values()]) for r in results for step in r[name])
        assert worst <= TOL, (name, args, kw, worst)
