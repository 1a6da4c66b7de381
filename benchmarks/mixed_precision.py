"""A pipelined bf16/fp16 step against single-process autocast of the same model and batch: loss and gradients."""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dapple  # noqa: E402
from dapple.models import GPT, lm_loss, random_tokens  # noqa: E402
from dapple.planner import Stage  # noqa: E402
from dapple.profiler import trace_layers  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_model(n_embd: int) -> GPT:
    torch.manual_seed(0)  # every rank builds the same model
    return GPT(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=n_embd)


def make_plan(model: GPT, batch: int, micro_batch: int) -> dapple.Plan:
    """1 -> 2 -> 1: embeddings and the first block, the second block on two replicas, the final norm and head."""
    names = trace_layers(model).names
    a, b = names.index("blocks.1"), names.index("ln_f")
    return dapple.Plan(global_batch_size=batch, micro_batch_size=micro_batch, layer_names=names,
                       stages=[Stage((0, a), [0]), Stage((a, b), [1, 2]), Stage((b, len(names)), [3])])


def reference(model: GPT, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None
              ) -> tuple[float, dict[str, torch.Tensor]]:
    """One single-process step, under autocast to ``dtype`` (None: float32)."""
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = lm_loss(ref(x), y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in ref.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run(precision: str, batch: int, micro_batch: int, n_embd: int, seq: int) -> dict[str, float]:
    """On each rank: one pipelined step; the largest relative differences from single-process autocast."""
    model = make_model(n_embd)
    x, y = random_tokens(batch, seq, 64, generator=torch.Generator().manual_seed(1))
    pipe = dapple.pipeline(model, make_plan(model, batch, micro_batch), lm_loss, mixed_precision=precision)
    ref_loss, ref = reference(model, x, y, DTYPES[precision])
    _, full = reference(model, x, y, None)
    loss = pipe.train_step(x, y)  # fp16: the gradients come back unscaled, as after GradScaler.unscale_
    grads = {n: p.grad for n, p in pipe.named_parameters() if p.grad is not None}
    return {"loss": abs(loss - ref_loss) / abs(ref_loss),
            "grads": max(rel(g, ref[n]) for n, g in grads.items()),
            "autocast_vs_fp32": max(rel(ref[n], full[n]) for n in grads)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--precision", nargs="+", default=["bf16", "fp16"], choices=list(DTYPES))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    a = ap.parse_args()
    print("precision | loss rel. diff | max grad rel. diff | autocast vs fp32 (grads)")
    for p in a.precision:
        out = dapple.runtime.launch(run, 4, p, a.batch, a.micro_batch, a.n_embd, a.seq)
        worst = {k: max(r[k] for r in out.values()) for k in ("loss", "grads", "autocast_vs_fp32")}
        print(f"{p} | {worst['loss']:.2e} | {worst['grads']:.2e} | {worst['autocast_vs_fp32']:.2e}")


if __name__ == "__main__":
    main()
