"""Large models: each rank's peak memory building its stage from the meta device against building the whole model,
loading only the stage's weights from a sharded checkpoint, and profiling the model one layer at a time.

    PYTHONPATH=$PWD python benchmarks/large_model.py                   # 1.1B-parameter Llama, 4 CPU processes
    PYTHONPATH=$PWD python benchmarks/large_model.py --layers 4        # a smaller model, for a quick look

The model is dapple's Llama in TinyLlama-1.1B's shape (fp32: 4.4 GB). The script writes it once as a sharded
safetensors checkpoint (``--shard-gb`` per file, as transformers shards), then runs, on ``--nproc`` processes under
a straight plan of that many stages balanced by parameter bytes:

- meta: every rank builds the model on the meta device, ``dapple.pipeline`` makes its stage real,
  ``dapple.load_weights`` reads the stage's tensors, and it trains ``--steps`` SGD steps (no momentum);
- full: every rank builds the whole model on the CPU (the same weights), ``dapple.pipeline`` keeps its stage (the
  rest is dropped), and it trains the same steps; ``--full-layers`` runs it on a model of fewer blocks (where the
  machine cannot hold ``nproc`` whole models at once);
- profile: one process profiles the meta model (``dapple.profile``, each layer made real, timed and freed).

Memory is each process's peak resident set (Linux's VmHWM, reset after start-up) less what it held before building
the model; on CUDA (``--device cuda``, one process per GPU or, with DAPPLE_SHARE_GPUS=1, several on one) it is
``torch.cuda.max_memory_allocated``, and ``--memory-fraction`` caps what each process may allocate
(``torch.cuda.set_per_process_memory_fraction``), e.g. below the model's bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import dapple
from dapple.models import Llama, LlamaConfig, lm_loss
from dapple.planner import Plan, Stage
from dapple.profiler import trace_layers
from dapple.runtime import ActivationMeter, launch


# ---- memory ---------------------------------------------------------------------------------------------
def _status(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def reset_peak(device: str) -> int:
    """Start counting the peak from now; returns the memory held now."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS
    return _status("VmRSS")


def peak(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device == "cuda" else _status("VmHWM")


# ---- the model, its checkpoint and the plan ----------------------------------------------------------------
def config(layers: int) -> LlamaConfig:
    return LlamaConfig(num_hidden_layers=layers)  # TinyLlama-1.1B's shape with 22 layers


def full_model(layers: int) -> Llama:
    torch.manual_seed(0)
    return Llama(config(layers))


def write_checkpoint(layers: int, path: Path, shard_bytes: float) -> dict[str, Any]:
    """The full model as transformers shards it: files of at most ``shard_bytes`` in key order, and an index."""
    sd = full_model(layers).state_dict()
    shards: list[dict[str, torch.Tensor]] = [{}]
    for key, t in sd.items():
        if shards[-1] and sum(x.nbytes for x in shards[-1].values()) + t.nbytes > shard_bytes:
            shards.append({})
        shards[-1][key] = t
    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name))
        weight_map.update({k: name for k in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {"bytes": sum(t.nbytes for t in sd.values()), "files": len(shards)}


def balanced_plan(layers: int, nproc: int, batch: int, micro: int) -> Plan:
    """A straight plan of ``nproc`` stages of about equal parameter bytes."""
    with torch.device("meta"):
        model = Llama(config(layers))
    lg = trace_layers(model)
    sizes = [sum(p.numel() for _, p in params) for params in lg.params_by_layer()]
    n = len(sizes)
    # best[s][k]: the smallest largest stage over splits of layers [0, k) into s stages, and the last cut
    best = [[(float("inf"), 0)] * (n + 1) for _ in range(nproc + 1)]
    best[0][0] = (0, 0)
    for s in range(1, nproc + 1):
        for k in range(s, n + 1):
            best[s][k] = min((max(best[s - 1][j][0], sum(sizes[j:k])), j) for j in range(s - 1, k))
    cuts, k = [], n
    for s in range(nproc, 0, -1):
        cuts.append((best[s][k][1], k))
        k = best[s][k][1]
    bounds = cuts[::-1]
    return Plan(batch, micro, [Stage(b, [i]) for i, b in enumerate(bounds)], layer_names=lg.names)


# ---- per rank -------------------------------------------------------------------------------------------------
def _tokens(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, 32000, (batch, seq + 1), generator=torch.Generator().manual_seed(1))


def _start(device: str, memory_fraction: float | None) -> None:
    """The process group, and one small step of compute, so start-up allocations are not counted."""
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        if memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(memory_fraction)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    w = torch.randn(64, 64, requires_grad=True, device=device)
    (w @ w).sum().backward()


def _train(pipe: dapple.Pipeline, steps: int, batch: int, seq: int) -> tuple[list[float], int]:
    """``steps`` SGD steps; the losses, and the peak bytes of activations autograd held."""
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-4)  # no momentum: no optimizer state
    data = _tokens(batch, seq)
    losses = []
    with ActivationMeter(pipe.parameters()) as meter:
        for _ in range(steps):
            losses.append(pipe.train_step(data[:, :-1], data[:, 1:]))
            opt.step()
            opt.zero_grad(set_to_none=False)
    return losses, meter.peak


def rank_meta(ckpt: str, layers: int, plan: Plan, steps: int, seq: int, device: str,
              memory_fraction: float | None) -> dict[str, Any]:
    _start(device, memory_fraction)
    base = reset_peak(device)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = Llama(config(layers))
    pipe = dapple.pipeline(model, plan, lm_loss, init_fn=model.init_weights)  # only this stage becomes real
    built, t1 = peak(device) - base, time.perf_counter()
    loaded = dapple.load_weights(pipe, ckpt)
    after_load = peak(device) - base
    losses, activations = _train(pipe, steps, plan.global_batch_size, seq)
    return {"stage": pipe.stage, "stage_bytes": sum(p.nbytes for p in pipe.parameters()), "build_s": t1 - t0,
            "peak_built": built, "peak_loaded": after_load, "peak": peak(device) - base, "losses": losses,
            "activations": activations, "largest": max(p.nbytes for p in pipe.parameters()),
            "load": {"s": loaded.seconds, "bytes": loaded.bytes, "files": len(loaded.files),
                     "tensors": loaded.tensors}}


def rank_full(layers: int, plan: Plan, steps: int, seq: int, device: str, memory_fraction: float | None
              ) -> dict[str, Any]:
    _start(device, memory_fraction)
    base = reset_peak(device)
    t0 = time.perf_counter()
    model = full_model(layers).to(device)
    pipe = dapple.pipeline(model, plan, lm_loss)  # keeps this stage
    del model  # the other stages' tensors go with the model
    gc.collect()
    built, t1 = peak(device) - base, time.perf_counter()
    losses, _ = _train(pipe, steps, plan.global_batch_size, seq)
    return {"stage": pipe.stage, "stage_bytes": sum(p.nbytes for p in pipe.parameters()), "build_s": t1 - t0,
            "peak_built": built, "peak": peak(device) - base, "losses": losses}


def run_profile(layers: int, seq: int, device: str, memory_fraction: float | None) -> dict[str, Any]:
    torch.set_num_threads(1)
    if device == "cuda" and memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(memory_fraction)
    with torch.device("meta"):
        model = Llama(config(layers))
    data = _tokens(2, seq)
    base = reset_peak(device)
    t0 = time.perf_counter()
    prof = dapple.profile(model, data[:, :-1], lm_loss, targets=data[:, 1:], batch_sizes=(1, 2), repeats=3,
                          warmup=1, device=device, init_fn=model.init_weights)
    return {"peak": peak(device) - base, "s": time.perf_counter() - t0, "model_bytes": prof.param_bytes(),
            "layers": prof.num_layers, "reused": len(prof.meta["reused"]),
            "largest_layer_bytes": max(layer.param_bytes for layer in prof.layers)}


# ---- report -----------------------------------------------------------------------------------------------
def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def report(args: argparse.Namespace, ckpt: dict, meta: list[dict], full: list[dict] | None, prof: dict | None
           ) -> None:
    print(f"Llama {args.layers} layers: {_gb(ckpt['bytes'])} GB of fp32 parameters, checkpoint of {ckpt['files']} "
          f"safetensors shards; {args.nproc} processes, {args.steps} SGD step(s), global batch {args.batch}, "
          f"micro-batch {args.micro}, {args.seq} tokens, device {args.device}")
    print("\nrank stage  stage GB | meta: peak GB  x stage  (built, loaded)  load s  read GB  files | full: peak GB"
          "  x stage")
    for r, m in enumerate(meta):
        f = full[r] if full else None
        x = m["stage_bytes"]
        row = (f"{r:>4} {m['stage']:>5} {_gb(x):>9} | {_gb(m['peak']):>13} {m['peak'] / x:>8.2f}"
               f"  ({m['peak_built'] / m['stage_bytes']:.2f}, {m['peak_loaded'] / m['stage_bytes']:.2f})"
               f"  {m['load']['s']:>7.2f} {_gb(m['load']['bytes']):>8} {m['load']['files']:>6}")
        if f:
            row += f" | {_gb(f['peak']):>13} {f['peak'] / f['stage_bytes']:>8.2f}"
        print(row)
    print("\nmeta peak, x stage bytes: parameters 1 + gradients 1 + activations held (peak) + the rest (the largest "
          "parameter's gradient of a micro-batch before it is added to .grad, allocator, runtime); the largest "
          "parameter")
    for r, m in enumerate(meta):
        acts, rest = m["activations"] / m["stage_bytes"], m["peak"] / m["stage_bytes"] - 2
        print(f"  rank {r}: {m['peak'] / m['stage_bytes']:.2f} = 2 + {acts:.2f} + {rest - acts:.2f}; largest "
              f"{m['largest'] / m['stage_bytes']:.2f}")
    same = full and args.full_layers == args.layers
    print(f"\nlast stage's losses: meta build {meta[-1]['losses']}" + (f", full build {full[-1]['losses']}" if same
                                                                       else ""))
    if full and not same:
        print(f"(the full build ran a model of {args.full_layers} layers: "
              f"{_gb(sum(f['stage_bytes'] for f in full))} GB)")
    if prof:
        print(f"\nprofile: peak {_gb(prof['peak'])} GB = {prof['peak'] / prof['model_bytes']:.3f} x the model's "
              f"{_gb(prof['model_bytes'])} GB (largest layer {_gb(prof['largest_layer_bytes'])} GB); "
              f"{prof['layers']} layers, {prof['reused']} took a repeated block's times; {prof['s']:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--full-layers", type=int, default=None, help="blocks of the full build's model (default: --layers)")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--shard-gb", type=float, default=1.0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--memory-fraction", type=float, default=None, help="CUDA: each process's allocation cap")
    p.add_argument("--skip", nargs="*", default=[], choices=["full", "profile"])
    p.add_argument("--dir", default=None, help="where the checkpoint is written (default: a temporary directory)")
    args = p.parse_args()
    args.full_layers = args.full_layers or args.layers
    root = Path(args.dir or tempfile.mkdtemp(prefix="dapple_large_"))
    ckpt = write_checkpoint(args.layers, root / "ckpt", args.shard_gb * 1e9)
    gc.collect()
    common = (args.steps, args.seq, args.device, args.memory_fraction)
    plan = balanced_plan(args.layers, args.nproc, args.batch, args.micro)
    meta = launch(rank_meta, args.nproc, str(root / "ckpt"), args.layers, plan, *common)
    full = None
    if "full" not in args.skip:
        full_plan = balanced_plan(args.full_layers, args.nproc, args.batch, args.micro)
        full = launch(rank_full, args.nproc, args.full_layers, full_plan, *common)
        full = [full[r] for r in sorted(full)]
    prof = None if "profile" in args.skip else launch(run_profile, 1, args.layers, args.seq, args.device,
                                                       args.memory_fraction)[0]
    report(args, ckpt, [meta[r] for r in sorted(meta)], full, prof)


if __name__ == "__main__":
    main()
