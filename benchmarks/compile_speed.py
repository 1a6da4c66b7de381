"""torch.compile against eager on one device: a one-stage pipeline of a GPT under bf16 autocast, median step time
and peak device memory of each.

Both engines are ``dapple.pipeline`` over the same weights and batch (one stage, M micro-batches), one built with
``compile=True``; their steps alternate in rounds after warm-up steps (the compiled one's first steps compile).
Memory is ``torch.cuda.max_memory_allocated`` over a step, reset before it (CUDA only). Public API only.

    PYTHONPATH=$PWD python benchmarks/compile_speed.py                    # CUDA: a GPT of about 1.1 B parameters
    PYTHONPATH=$PWD python benchmarks/compile_speed.py --n-layer 2 --n-embd 128 --seq 64 --vocab 512   # CPU size
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import dapple
from dapple.models import GPT, lm_loss, random_tokens
from dapple.planner import Stage


def _step_stats(step, device: torch.device) -> tuple[float, float]:
    """(ms, peak GB allocated) of one call of ``step``, the device synchronised around it."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - t0) * 1e3
    return ms, (torch.cuda.max_memory_allocated(device) / 1e9 if cuda else float("nan"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=20)
    p.add_argument("--n-embd", type=int, default=2048)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro", type=int, default=2, help="rows per micro-batch")
    p.add_argument("--mixed-precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per engine (the compiled one compiles)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per engine per round")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    torch.manual_seed(0)
    model = GPT(vocab_size=a.vocab, block_size=a.seq, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd)
    n_params = sum(q.numel() for q in model.parameters())
    names = dapple.profiler.trace_layers(model).names
    plan = dapple.Plan(global_batch_size=a.global_batch, micro_batch_size=a.micro,
                       stages=[Stage((0, len(names)), [0])], layer_names=names)
    x, y = random_tokens(a.global_batch, a.seq, a.vocab, torch.Generator().manual_seed(1))  # (B, T) each
    engines = {}
    for name, option in (("eager", False), ("compiled", True)):
        pipe = dapple.pipeline(copy.deepcopy(model), plan, lm_loss, timeout=600, mixed_precision=a.mixed_precision,
                               compile=option)
        xd, yd = x.to(pipe.ctx.device), y.to(pipe.ctx.device)
        engines[name] = (pipe, lambda pipe=pipe, xd=xd, yd=yd: pipe.train_step(xd, yd))
    device = engines["eager"][0].ctx.device
    del model
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{label}, torch {torch.__version__}: GPT {a.n_layer} x d={a.n_embd}, seq {a.seq}, vocab {a.vocab}, "
          f"{n_params / 1e9:.2f} B parameters, {a.mixed_precision}, one stage, global batch {a.global_batch} = "
          f"{a.global_batch // a.micro} x {a.micro}")
    drop = {k: (lambda pipe=pipe: [setattr(q, "grad", None) for q in pipe.parameters()]) for k, (pipe, _) in
            engines.items()}
    t0 = time.perf_counter()
    losses = {}
    for k, (_, step) in engines.items():
        for _ in range(a.warmup):
            drop[k]()
            losses[k] = step()
    print(f"warm-up ({a.warmup} steps each, compiling included): {time.perf_counter() - t0:.1f} s; first losses "
          f"eager {losses['eager']:.5f}, compiled {losses['compiled']:.5f}")
    stats: dict[str, list[tuple[float, float]]] = {k: [] for k in engines}
    for r in range(a.rounds):
        for k in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            for _ in range(a.steps):
                drop[k]()
                stats[k].append(_step_stats(engines[k][1], device))
    med = {k: (statistics.median(t for t, _ in v), max(m for _, m in v)) for k, v in stats.items()}
    for k, (ms, gb) in med.items():
        print(f"  {k:<9} median step {ms:9.2f} ms, peak allocated {gb:7.2f} GB")
    print(f"compiled / eager: step {med['compiled'][0] / med['eager'][0]:.3f}x, "
          f"peak memory {med['compiled'][1] / med['eager'][1]:.3f}x")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
