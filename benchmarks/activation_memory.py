"""Peak memory per stage at a fixed micro-batch size as M grows: dapple (early backward) vs gpipe.

Two measures per rank, each (schedule, M) in fresh processes (a clean allocator):

- saved activations: the bytes of the tensors autograd saves for backward and holds at once
  (``dapple.runtime.ActivationMeter``: parameters excluded, a view counts its own bytes, a tensor saved twice once);
- process peak: what two steps add to the process at their peak over the memory held before the first (model,
  the global batch): the RSS high-water mark on the CPU (reset through /proc/self/clear_refs), or
  ``torch.cuda.max_memory_allocated`` on a GPU. Everything a step holds counts: activations, gradients, buffers in
  flight, sends not yet known delivered, what the first step sets up.

Early backward bounds both by K_i whatever M is (paper Table 5); gpipe's grow with M.

    PYTHONPATH=$PWD python benchmarks/activation_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _memory import rss  # benchmarks/_memory.py
from torch import nn

import dapple
from dapple.models import GPT, lm_loss, random_tokens
from dapple.planner import Stage
from dapple.profiler import trace_layers

MODES = {"recompute": True, "layers": "layers", "selective": "selective"}  # --recompute -> recompute=


def _process_peak(steps, device: torch.device) -> int:
    """Bytes ``steps()`` adds to this process at its peak."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        steps()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts from the current RSS
    base, _ = rss()
    steps()
    return rss()[1] - base


def _gpt(args: argparse.Namespace, g: int) -> tuple[nn.Module, list[int], Any, torch.Tensor, torch.Tensor]:
    """The GPT of ``args``, its stage cuts (layer indices), its loss and a batch of ``g`` token rows."""
    model = GPT(vocab_size=args.vocab, block_size=args.seq, n_layer=args.stages * args.blocks, n_head=4,
                n_embd=args.embd)
    names = trace_layers(model).names
    cuts = [0] + [names.index(f"blocks.{args.blocks * s}") for s in range(1, args.stages)] + [len(names)]
    x, y = random_tokens(g, args.seq, args.vocab, generator=torch.Generator().manual_seed(0))
    return model, cuts, lm_loss, x, y


def _mlp(args: argparse.Namespace, g: int) -> tuple[nn.Module, list[int], Any, torch.Tensor, torch.Tensor]:
    """An MLP on rows of ``--embd`` floats (``--blocks`` linear layers per stage), its cuts, MSE and a batch: a
    model whose input batch is as large as its activations, where what the input checks hold shows."""
    width, n = args.embd, args.stages * args.blocks
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)])
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(g, width, generator=gen), torch.randn(g, width, generator=gen)
    names = trace_layers(model).names
    first = [next(i for i, name in enumerate(names) if name.split(".")[0] == str(s * args.blocks))
             for s in range(args.stages)]
    return model, first + [len(names)], nn.functional.mse_loss, x, y


def run(args: argparse.Namespace, m: int, variant: str) -> dict[str, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = args.micro_batch * m
    model, cuts, loss_fn, x, y = (_mlp if args.model == "mlp" else _gpt)(args, g)
    names = trace_layers(model).names
    stages = [Stage((cuts[s], cuts[s + 1]), [s]) for s in range(args.stages)]
    schedule, _, extra = variant.partition("+")
    plan = dapple.Plan(global_batch_size=g, micro_batch_size=args.micro_batch, schedule=schedule, stages=stages,
                       layer_names=names)
    pipe = dapple.pipeline(model, plan, loss_fn, timeout=600, recompute=MODES.get(extra, False),
                           check_inputs=not args.no_check_inputs)
    dist.barrier()
    # from before the first step (the allocator keeps what a step frees, so a later baseline would hide it)
    process = _process_peak(lambda: [pipe.train_step(x, y) for _ in range(2)], pipe.ctx.device)
    with dapple.runtime.ActivationMeter(pipe.parameters()) as meter:  # (recompute: its own hooks hide the saves)
        pipe.train_step(x, y)
    times = []
    for _ in range(args.timed_steps):
        dist.barrier()
        start = time.perf_counter()
        pipe.train_step(x, y)
        times.append(time.perf_counter() - start)
    return {"saved": meter.peak, "process": process, "step_s": statistics.median(times) if times else 0.0}


def _modelled(args: argparse.Namespace, modes: list[str], m: int) -> None:
    """The planner's peak per stage under each recompute mode over its peak without, from a profile of the model
    (dapple.profile at the micro-batch size; ``cluster``: one server, memory to spare)."""
    torch.manual_seed(0)
    model, cuts, loss_fn, x, y = (_mlp if args.model == "mlp" else _gpt)(args, args.micro_batch)
    prof = dapple.profile(model, (x,), targets=(y,), loss_fn=loss_fn, batch_sizes=[args.micro_batch], repeats=3,
                          progress=False, selective="selective" in modes)
    cluster = dapple.Cluster(1, args.stages, 1e10, 1e10, 0.0, 0.0, 1e12)
    stages = [Stage((cuts[s], cuts[s + 1]), [s]) for s in range(args.stages)]
    plan = dapple.Plan(global_batch_size=args.micro_batch * m, micro_batch_size=args.micro_batch, stages=stages,
                       layer_names=prof.layer_names)
    peak = {mode: [s["memory_gb"] for s in dapple.planner.evaluate(prof, cluster, plan, recompute=MODES.get(
        mode, False)).details["stages"]] for mode in ["off", *modes]}
    static = [b / 1e9 for b in _static(prof, cuts, args.stages)]
    for mode in modes:  # activations only: the model's static bytes (parameters x optimizer factor) left out
        ratio = [(peak[mode][r] - static[r]) / (peak["off"][r] - static[r]) for r in range(args.stages)]
        print(f"{mode} / dapple, modelled (planner, activations): {', '.join(f'{v:.3f}x' for v in ratio)}")


def _static(prof: Any, cuts: list[int], stages: int) -> list[float]:
    """Parameters x the optimizer factor (4) per stage, as the planner counts them."""
    return [4.0 * sum(layer.param_bytes for layer in prof.layers[cuts[s]:cuts[s + 1]]) for s in range(stages)]


def _median_of(repeats: int, once) -> dict[int, dict[str, int]]:
    """Per rank, the run whose process peak is the median of ``repeats`` fresh runs (the allocator's reuse of
    freed memory varies from run to run)."""
    runs = [once() for _ in range(repeats)]
    return {r: sorted((run[r] for run in runs), key=lambda v: v["process"])[repeats // 2] for r in runs[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--micro-batch", type=int, default=128, help="rows per micro-batch (fixed)")
    p.add_argument("--stages", type=int, default=2, help="stages, one rank each")
    p.add_argument("--model", choices=("gpt", "mlp"), default="gpt",
                   help="gpt: token ids in; mlp: rows of --embd floats in (inputs as large as activations)")
    p.add_argument("--blocks", type=int, default=2, help="GPT blocks (or MLP layers) per stage")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1, help="fresh runs per point; the median process peak is shown")
    p.add_argument("--recompute", nargs="*", choices=tuple(MODES), default=None,
                   help="also dapple with every stage recomputing: whole (recompute, the default when the flag is "
                        "given alone), layer by layer, selectively")
    p.add_argument("--timed-steps", type=int, default=0, help="also time this many steps (median, seconds)")
    p.add_argument("--no-check-inputs", action="store_true", help="dapple.pipeline(..., check_inputs=False)")
    p.add_argument("--schedules", nargs="+", default=["dapple", "gpipe"], choices=("dapple", "gpipe"))
    p.add_argument("--json", help="also write the raw peaks here")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    modes = [] if args.recompute is None else (args.recompute or ["recompute"])
    variants = tuple(args.schedules) + tuple(f"dapple+{m}" for m in modes)
    res = {(s, m): _median_of(args.repeats, lambda: dapple.runtime.launch(run, args.stages, args, m, s))
           for s in variants for m in args.micro_batches}
    shape = f"x seq {args.seq}" if args.model == "gpt" else f"rows of {args.embd} floats"
    print(f"{args.model.upper()}, {args.blocks} blocks per stage on {args.stages} ranks, micro-batch "
          f"{args.micro_batch} "
          f"{shape}, check_inputs={not args.no_check_inputs}; per stage: saved activations (MiB) / process peak over "
          f"the memory before the first step (MiB)")
    print(f"{'schedule/M':<14}" + "".join(f"{'stage ' + str(s):>18}" for s in range(args.stages)))
    for (sched, m), per in res.items():
        print(f"{sched + '/' + str(m):<14}" + "".join(
            f"{per[r]['saved'] / 2**20:>9.1f} /{per[r]['process'] / 2**20:>7.1f}" for r in range(args.stages)))
    lo, hi = min(args.micro_batches), max(args.micro_batches)
    for what in ("saved", "process"):
        for r in range(args.stages):
            at = {k: v[r][what] for k, v in res.items()}
            gp = ("gpipe", hi) in at
            vs = f"; dapple / gpipe at M={hi} = {at['dapple', hi] / at['gpipe', hi]:.3f}x" if gp else ""
            if ("dapple", hi) in at:
                print(f"{what}, stage {r}: dapple M={hi} / M={lo} = {at['dapple', hi] / at['dapple', lo]:.3f}x{vs}")
    if modes:
        _modelled(args, modes, hi)
    for mode in modes:
        ratio = [res[f"dapple+{mode}", hi][r][what] / res["dapple", hi][r][what]
                 for what in ("saved", "process") for r in range(args.stages)]
        print(f"{mode} / dapple at M={hi}, saved activations per stage: "
              f"{', '.join(f'{v:.3f}x' for v in ratio[:args.stages])}; process peak per stage: "
              f"{', '.join(f'{v:.3f}x' for v in ratio[args.stages:])}")
        if args.timed_steps:
            slow = res[f"dapple+{mode}", hi][0]["step_s"] / res["dapple", hi][0]["step_s"]
            print(f"{mode} / dapple at M={hi}, median step time: {slow:.3f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "peaks": {f"{s}/{m}": v for (s, m), v in res.items()}}, fh, indent=1)


if __name__ == "__main__":
    main()
