"""How long profiling a 12-block GPT takes, and how the sum of per-layer fwd+bwd compares with a whole step.

    python benchmarks/profile_gpt.py                      # 12 blocks, d=256, seq 128, batch sizes 4 8, 3 trials
    python benchmarks/profile_gpt.py --threads 2 --trials 5

For each trial: profile the model (dapple.profile, loss included in the last layer, check_step=True so
whole-model steps are also timed in the same rounds as the layers), and time whole-model training steps
(forward + loss + backward, --repeats after --warmup, both before and after profiling, median of all) at each
profiled batch size; report the sum over layers of (forward_ms + backward_ms) / step_ms against both, and what
the cost model charges the model as one stage (meta["stage_over_step"]: the layers less Profile.call_ms, plus
call_ms once) over the in-round step. Medians
over the trials are printed last. On a shared machine the in-round ratio is the fair one: both sides see the
same load. Uses only the public API.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dapple
from dapple.models import GPT, lm_loss, random_tokens


def step_times(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, repeats: int, warmup: int) -> list[float]:
    """ms of ``repeats`` training steps (zero_grad, forward, loss, backward) on the whole model, after warm-up."""
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    times = []
    for i in range(warmup + repeats):
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        lm_loss(model(x), y).backward()
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    model.zero_grad(set_to_none=True)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch.set_num_threads (default 1, as the runtime sets per process; 0: torch's default)")
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = GPT(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab,
                block_size=args.seq).to(device)
    x, y = random_tokens(max(args.batch_sizes), args.seq, args.vocab, generator=torch.Generator().manual_seed(0))
    x, y = x.to(device), y.to(device)
    print(f"GPT {args.n_layer} blocks, d={args.n_embd}, seq {args.seq}, batch sizes {args.batch_sizes}, "
          f"{device}, {torch.get_num_threads()} threads, repeats {args.repeats}, warmup {args.warmup}")

    seconds, ratios, inside = [], {b: [] for b in args.batch_sizes}, {b: [] for b in args.batch_sizes}
    staged: dict = {b: [] for b in args.batch_sizes}  # meta["stage_over_step"]: what the cost model charges
    for trial in range(args.trials):
        before = {b: step_times(model, x[:b], y[:b], args.repeats, args.warmup) for b in args.batch_sizes}
        t0 = time.perf_counter()
        prof = dapple.profile(model, x, lm_loss, args.batch_sizes, targets=y, repeats=args.repeats,
                              warmup=args.warmup, device=device, check_step=True)
        seconds.append(time.perf_counter() - t0)
        line = [f"trial {trial}: profiled {prof.num_layers} layers in {seconds[-1]:.1f} s"]
        for i, b in enumerate(prof.batch_sizes):
            layers_ms = sum(layer.forward_ms[i] + layer.backward_ms[i] for layer in prof.layers)
            whole_ms = statistics.median(before[b] + step_times(model, x[:b], y[:b], args.repeats, args.warmup))
            ratios[b].append(layers_ms / whole_ms)
            inside[b].append(prof.meta["layers_over_step"][i])
            staged[b].append(prof.meta["stage_over_step"][i])
            line.append(f"batch {b}: sum of layers {layers_ms:.1f} ms, whole step {whole_ms:.1f} ms before+after / "
                        f"{prof.meta['step_ms'][i]:.1f} ms during profiling, ratio {ratios[b][-1]:.3f} / "
                        f"{inside[b][-1]:.3f}, as one stage (call_ms {prof.call_ms} once) {staged[b][-1]:.3f}")
        print("; ".join(line), flush=True)
    print(f"median profiling time {statistics.median(seconds):.1f} s over {args.trials} trials; median ratio "
          "sum of layers / whole step timed before+after (timed in the same rounds; as one stage): "
          + ", ".join(f"batch {b}: {statistics.median(ratios[b]):.3f} ({statistics.median(inside[b]):.3f}; "
                      f"{statistics.median(staged[b]):.3f})" for b in ratios))
    print(prof)


if __name__ == "__main__":
    main()
