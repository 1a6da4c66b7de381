"""dapple.plan with recompute=False / True / "auto" (and bf16) on an activation-heavy GPT-like profile whose
parameters do not fit data-parallel: the plans, their modelled and simulated latency, and what recomputes."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapple import Cluster, Profile, plan, simulate  # noqa: E402
from dapple.profiler import LayerProfile  # noqa: E402


def gpt_profile(blocks: int, hidden: int, seq: int, heads: int, vocab: int, tflops: float) -> Profile:
    """Analytic per-row costs of a GPT in fp32, profiled at batch 1: a block's forward 24 s h^2 + 4 s^2 h flops at
    ``tflops``, backward twice that; it saves 2 (34 s h + 5 a s^2) bytes (the fp16 count of Korthikanti et al.,
    doubled) and sends s h x 4 bytes; 12 h^2 fp32 parameters. The embedding and the head hold vocab x h each."""
    ms = 1e3 / (tflops * 1e12)
    block_f = (24 * seq * hidden ** 2 + 4 * seq ** 2 * hidden) * ms
    send = seq * hidden * 4
    saved = 2 * (34 * seq * hidden + 5 * heads * seq ** 2)
    head_f = 2 * seq * hidden * vocab * ms
    layers = [LayerProfile("embed", [0.01], [0.02], [send], [send], vocab * hidden * 4)]
    layers += [LayerProfile(f"block{i}", [block_f], [2 * block_f], [send], [saved], 12 * hidden ** 2 * 4)
               for i in range(blocks)]
    layers.append(LayerProfile("head", [head_f], [2 * head_f], [4], [seq * vocab * 4], vocab * hidden * 4))
    return Profile(f"gpt{blocks}x{hidden}", "analytic", [1], layers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--blocks", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--tflops", type=float, default=50.0, help="effective fp32 throughput of a device")
    p.add_argument("--cluster", default="A", help="preset A, B or C")
    p.add_argument("--memory", type=float, default=16e9, help="device memory, bytes")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--bf16", action="store_true", help="also each mode with mixed_precision='bf16'")
    args = p.parse_args()
    prof = gpt_profile(args.blocks, args.hidden, args.seq, args.heads, args.vocab, args.tflops)
    cluster = dataclasses.replace(Cluster.preset(args.cluster), device_memory=args.memory)
    print(f"{prof.model}: {prof.param_bytes() / 1e9:.2f} GB of parameters (x4 with Adam: "
          f"{4 * prof.param_bytes() / 1e9:.1f} GB), {sum(prof.costs(1).saved_bytes) / 1e9:.2f} GB saved per row; "
          f"{cluster.name}, {args.memory / 1e9:g} GB per device, global batch {args.global_batch}")
    print("| mixed precision | recompute | shape | micro-batch | K_i | stages recomputing | modelled ms | "
          "simulated ms | planning s |")
    print("|---|---|---|---:|---|---|---:|---:|---:|")
    for mp in (None, "bf16") if args.bf16 else (None,):
        for rc in (False, True, "auto"):
            t = time.perf_counter()
            try:
                pl = plan(prof, cluster, args.global_batch, args.micro_batch, recompute=rc, mixed_precision=mp,
                          verify=0, workers=1)
            except ValueError as e:
                print(f"| {mp or 'fp32'} | {rc} | no plan fits: {str(e)[:60]}... | | | | | | |")
                continue
            took = time.perf_counter() - t
            sim = simulate(pl, prof, cluster).latency_ms
            flags = [i for i, s in enumerate(pl.stages) if s.recompute]
            print(f"| {mp or 'fp32'} | {rc} | {pl.shape} | {pl.micro_batch_size} | {pl.warmup} | "
                  f"{flags if len(flags) < pl.num_stages else 'all'} | {pl.estimate.latency_ms:.1f} | {sim:.1f} | "
                  f"{took:.1f} |", flush=True)


if __name__ == "__main__":
    main()
