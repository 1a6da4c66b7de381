"""``dapple demo``: profile the built-in GPT, plan it for local processes, train it pipelined, print the loss."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import cast

import torch
import torch.distributed as dist

from .. import Cluster, Plan, Profile, pipeline, plan, profile
from ..core.dist import SHARE_GPUS
from ..models import GPT, lm_loss
from ..planner import memory_needed
from ..runtime import launch
from ..runtime.distributed import default_backend


@dataclass
class DemoConfig:
    nproc: int = 4  # local processes (ranks) to plan for and train on
    steps: int = 30
    global_batch: int = 32
    seq: int = 32
    vocab: int = 128
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    lr: float = 3e-3
    # device memory per rank: this share of what one rank needs to hold the whole model (its parameters with Adam
    # state, x4, and one row's activations): below 1 the model must be split into stages
    memory_fraction: float = 0.6
    trace: str | None = None  # write a Chrome trace of the last step here
    seed: int = 0


def make_model(cfg: DemoConfig) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)  # every rank builds the same initial model
    return GPT(vocab_size=cfg.vocab, block_size=cfg.seq, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd)


def make_batch(cfg: DemoConfig, step: int, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of a toy language (each token decides the next through a fixed random permutation, so the
    model can learn it): (inputs, next-token targets), both (rows, seq); the same on every rank."""
    rows = rows or cfg.global_batch
    gen = torch.Generator().manual_seed(cfg.seed)
    table = torch.randperm(cfg.vocab, generator=gen)  # the language's rule: token -> next token
    gen.manual_seed(cfg.seed * 100_003 + step + 1)
    tokens = torch.empty(rows, cfg.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab, (rows,), generator=gen)
    for t in range(cfg.seq):
        tokens[:, t + 1] = table[tokens[:, t]]
    return tokens[:, :-1], tokens[:, 1:]


def run(cfg: DemoConfig) -> dict:
    """Profile -> Cluster.local (measured) -> plan -> train on ``cfg.nproc`` processes; returns a summary."""
    _check(cfg)
    torch.set_num_threads(1)
    prof = _profile(cfg)
    print(f"[2/4] measuring the links between {cfg.nproc} local processes ...", flush=True)
    cluster = _local_cluster(cfg, prof)
    print("[3/4] planning ...", flush=True)
    the_plan = plan(prof, cluster, cfg.global_batch, overlap=True)
    if the_plan.estimate is None:
        raise RuntimeError(f"plan() gave a plan without its estimate: {the_plan}")
    print(the_plan)
    print(f"[4/4] training {cfg.steps} steps on {cfg.nproc} processes ({default_backend()}) ...", flush=True)
    summary = launch(_train, cfg.nproc, asdict(cfg), the_plan.to_dict())[0]
    losses = summary["losses"]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; median step "
          f"{summary['step_ms']:.1f} ms (planner's estimate {the_plan.estimate.latency_ms:.1f} ms"
          + (f"; {cfg.nproc} processes share {os.cpu_count()} CPU cores here)" if cfg.nproc > (os.cpu_count() or 1)
             else ")"))
    if cfg.trace:
        print(f"wrote {cfg.trace}: draw it with 'dapple show {cfg.trace} --png schedule.png'")
    return {"plan": the_plan, "losses": losses, "step_ms": summary["step_ms"]}


def _check(cfg: DemoConfig) -> None:
    """ValueError naming the setting unless the demo can run as configured on this machine."""
    if not 1 <= cfg.nproc <= cfg.global_batch:
        raise ValueError(f"nproc: expected 1 .. global batch ({cfg.global_batch}) processes, got {cfg.nproc}")
    if cfg.steps < 1:
        raise ValueError(f"steps: expected at least 1, got {cfg.steps}")
    if not 0 < cfg.memory_fraction < float("inf"):
        raise ValueError(f"memory_fraction: expected a positive share of what one process needs for the whole model "
                         f"(below 1: a pipeline), got {cfg.memory_fraction}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and cfg.nproc > gpus and os.environ.get(SHARE_GPUS) != "1":
        raise ValueError(f"nproc: {cfg.nproc} processes, but this machine has {gpus} GPU(s); pass --nproc {gpus}, "
                         f"or set {SHARE_GPUS}=1 to put several on a GPU (for checking, not timing)")


def _profile(cfg: DemoConfig) -> Profile:
    x, y = make_batch(cfg, 0)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "this CPU"
    print(f"[1/4] profiling the built-in GPT ({cfg.n_layer} blocks, d={cfg.n_embd}, seq {cfg.seq}) on {where} ...",
          flush=True)
    # a GPU runs these tiny layers as fast as Python launches them, so their times jitter: more rounds there
    repeats, warmup = (10, 3) if torch.cuda.is_available() else (3, 1)
    prof = profile(make_model(cfg), x, lm_loss, batch_sizes=(2, 8), targets=y, progress=False, name="demo-gpt",
                   repeats=repeats, warmup=warmup)
    print(f"      {prof.num_layers} layers, {prof.param_bytes() / 1e6:.2f} MB of parameters, "
          f"profiled in {prof.meta['profiling_seconds']:.1f} s")
    return prof


def _local_cluster(cfg: DemoConfig, prof: Profile) -> Cluster:
    """This machine's processes, with device memory capped at ``cfg.memory_fraction`` of the whole model's needs."""
    static = 4 * prof.param_bytes()  # fp32 weights, gradients and Adam's two moments
    whole = memory_needed(prof, 1)  # static + the activations one row (sample) saves for the backward
    row = whole - static
    # the least one process needs to hold the whole model (micro-batches of one row): a share of it leaves a single
    # stage no room, however micro-batched, so the plan is a pipeline (one process: no cap)
    memory = cfg.memory_fraction * whole if cfg.nproc > 1 else None
    cluster = Cluster.local(cfg.nproc, device_memory=memory)  # measures the links when nproc > 1
    print(f"      {cluster}")
    if memory is not None:
        print(f"      device memory capped at {memory / 1e6:.2f} MB per process: {cfg.memory_fraction:g} x the "
              f"{(static + row) / 1e6:.2f} MB one process needs for the whole model ({static / 1e6:.2f} MB of "
              f"parameters with their Adam state, {row / 1e6:.2f} MB of activations per row)"
              + (", so the planner splits it into stages" if cfg.memory_fraction < 1 else ""))
    return cluster


def _train(cfg_dict: dict, plan_dict: dict) -> dict | None:
    """One rank of the demo's training run (started by ``dapple.runtime.launch``)."""
    torch.set_num_threads(1)
    cfg = DemoConfig(**cfg_dict)
    pipe = pipeline(make_model(cfg), Plan.from_dict(plan_dict), lm_loss, timeout=120)
    opt = torch.optim.AdamW(pipe.parameters(), lr=cfg.lr)
    rank, losses, times = dist.get_rank(), [], []
    for step in range(cfg.steps):
        x, y = make_batch(cfg, step)
        last = step == cfg.steps - 1 and cfg.trace
        t0 = time.perf_counter()
        if last:
            with pipe.trace() as tr:
                loss = pipe.train_step(x, y)
        else:
            loss = pipe.train_step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if last:
            tr.save(cast(str, cfg.trace))  # last: only with a trace path
        if rank == 0 and (step % 5 == 0 or step == cfg.steps - 1):
            print(f"      step {step + 1:>3}/{cfg.steps}  loss {loss:.4f}  ({times[-1] * 1e3:.1f} ms)", flush=True)
    dist.destroy_process_group()  # flushes this rank's last transfers (NCCL) before it exits; peers may need them
    return {"losses": losses, "step_ms": statistics.median(times[1:] or times) * 1e3} if rank == 0 else None
