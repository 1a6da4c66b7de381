"""The built-in GPT profiled through torch.fx and through torch.export: same sizes, layer times side by side.

    python benchmarks/export_vs_fx.py                  # 4 blocks, d=128, seq 64, batch sizes 4 8, 5 trials
    python benchmarks/export_vs_fx.py --trials 9 --layers 8

Each trial profiles the same model twice (tracer="fx", then tracer="export", interleaved so both see the same
load) and records the sum over layers of forward_ms + backward_ms at the largest batch size. Prints whether the
sizes (boundary, saved, parameter bytes) agree exactly, the per-trial sums, and the ratio of the medians.
Uses only the public API.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import dapple
from dapple.models import GPT
from dapple.models.gpt import lm_loss, random_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(n_layer=args.layers, n_embd=args.embd, n_head=4, block_size=args.seq)
    x, y = random_tokens(max(args.batch_sizes), args.seq, model.cfg.vocab_size)
    sums: dict[str, list[float]] = {"fx": [], "export": []}
    sizes: dict[str, list] = {}
    for _ in range(args.trials):
        for method in sums:
            prof = dapple.profile(model, x, lm_loss, args.batch_sizes, targets=y, tracer=method, progress=False)
            sums[method].append(sum(layer.forward_ms[-1] + layer.backward_ms[-1] for layer in prof.layers))
            sizes[method] = [(layer.name, layer.boundary_bytes, layer.saved_bytes, layer.param_bytes)
                             for layer in prof.layers]
    print(f"GPT {args.layers}x{args.embd}, seq {args.seq}, batch {max(args.batch_sizes)}, {args.threads} thread(s)")
    print("sizes identical (names, boundary, saved, param bytes):", sizes["fx"] == sizes["export"])
    for method, values in sums.items():
        print(f"{method:>6}: sum of layer fwd+bwd ms per trial {[round(v, 2) for v in values]}, "
              f"median {statistics.median(values):.2f}")
    print(f"export / fx (medians): {statistics.median(sums['export']) / statistics.median(sums['fx']):.3f}")


if __name__ == "__main__":
    main()
