"""One device: dapple.pipeline (one stage, M micro-batches) vs plain gradient accumulation, and the planner's
estimate vs the measured step.

On one GPU (or the CPU) there is no pipeline to speak of, so this isolates two things a multi-GPU run
mixes with communication: the runtime's own cost per step (its input-shape check, the micro-batch loop,
the waits), and how well a profile taken on this device predicts a training step (the sum over layers of
the profiled forward and backward times, and ``plan.estimate``). A GPT is profiled with ``dapple.profile``,
planned with ``dapple.plan`` for ``Cluster.local(1)`` at ``--micro`` rows per micro-batch, and then
timed in interleaved rounds: plain (each micro-batch's loss scaled by rows / global batch, backward,
accumulated) and pipelined (``pipe.train_step``), both from the same weights. Gradients are dropped
between steps; no optimizer step. Figures are medians over rounds of each round's median. Public API only.

    PYTHONPATH=$PWD python benchmarks/gpu_single.py                        # CUDA if available, ~1 minute
    PYTHONPATH=$PWD python benchmarks/gpu_single.py --n-embd 256 --seq 64  # a size the CPU can do
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import dapple
from dapple.models import GPT, lm_loss, random_tokens


def timed(step, sync) -> float:
    """ms of one call of ``step``, the device synchronised around it."""
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro", type=int, nargs="+", default=[8, 4], help="rows per micro-batch (M = global / micro)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per engine per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    a = p.parse_args()
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = GPT(vocab_size=a.vocab, block_size=a.seq, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd)
    x, y = random_tokens(a.global_batch, a.seq, a.vocab, torch.Generator().manual_seed(1))  # (B, T) each
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device {name}, torch {torch.__version__}; GPT {a.n_layer} blocks d={a.n_embd} seq {a.seq} "
          f"vocab {a.vocab}, {sum(q.numel() for q in model.parameters()) / 1e6:.1f} M parameters, fp32, "
          f"global batch {a.global_batch}")
    t0 = time.perf_counter()
    prof = dapple.profile(copy.deepcopy(model), x[:min(a.micro)], lm_loss, batch_sizes=tuple(sorted(set(a.micro))),
                          targets=y[:min(a.micro)], device=device, progress=False, name="gpt")
    took = time.perf_counter() - t0
    print(f"profiled {prof.num_layers} layers at batch sizes {sorted(set(a.micro))} in {took:.1f} s")
    cluster = dapple.Cluster.local(1, device_memory=1e12)
    plain = copy.deepcopy(model).to(device)
    xd, yd = x.to(device), y.to(device)
    for micro in a.micro:
        plan = dapple.plan(prof, cluster, a.global_batch, micro)
        m = a.global_batch // micro
        pipe = dapple.pipeline(copy.deepcopy(model), plan, lm_loss)

        def plain_step() -> float:
            total = 0.0
            for i in range(m):  # gradient accumulation: the same sum the pipeline computes
                lo, hi = i * micro, (i + 1) * micro
                loss = lm_loss(plain(xd[lo:hi]), yd[lo:hi]) * (micro / a.global_batch)
                loss.backward()
                total += float(loss.detach())
            return total

        engines = {"plain": plain_step, "dapple": lambda: pipe.train_step(xd, yd)}
        drop = {"plain": lambda: plain.zero_grad(set_to_none=True),
                "dapple": lambda: [setattr(q, "grad", None) for q in pipe.parameters()]}
        losses = {}
        for k, f in engines.items():  # warm-up, and the first step's loss of each
            drop[k]()
            losses[k] = float(f())
            drop[k]()
            f()
        per_round: dict[str, list[float]] = {k: [] for k in engines}
        for r in range(a.rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for k in order:
                times = []
                for _ in range(a.steps):
                    drop[k]()  # gradients dropped before each step, untimed
                    times.append(timed(engines[k], sync))
                per_round[k].append(statistics.median(times))
        med = {k: statistics.median(v) for k, v in per_round.items()}
        costs = prof.costs(micro)
        summed = m * (sum(costs.forward_ms) + sum(costs.backward_ms))
        est = plan.estimate.latency_ms
        print(f"\nmicro-batch {micro} (M = {m}): loss plain {losses['plain']:.6f}, dapple {losses['dapple']:.6f} "
              f"(rel. diff {abs(losses['plain'] - losses['dapple']) / abs(losses['plain']):.1e})")
        print(f"  median step: plain {med['plain']:.2f} ms, dapple {med['dapple']:.2f} ms; "
              f"dapple / plain = {med['dapple'] / med['plain']:.3f}")
        print(f"  profile: sum of layers' F+B x M = {summed:.2f} ms = {summed / med['plain']:.3f} x plain; "
              f"plan estimate {est:.2f} ms = {est / med['dapple']:.3f} x dapple's measured step")
    if torch.distributed.is_initialized():  # dapple.pipeline made the group; ending it flushes NCCL cleanly
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
