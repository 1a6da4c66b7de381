"""Trace one training step of an emulated-accelerator pipeline on 4 local processes and draw it (paper Fig. 3/4).

Each of 4 stages holds one ``EmulatedLayer`` that sleeps ``ms_per_row`` per row forward and twice that
backward (the CPU stays free, as with a GPU kernel), so the picture shows the schedule itself: the dapple
(early backward, 1F1B) schedule and GPipe's all-forwards-first on the same stages, plus a hybrid plan (stage 0
replicated on 2 ranks: split-concat transfers and a gradient AllReduce). For each it writes a Chrome trace
(open it in https://ui.perfetto.dev or chrome://tracing) and a PNG drawn by ``dapple show --png``.

    PYTHONPATH=$PWD python examples/trace_emulated.py                 # writes docs/trace_{dapple,gpipe,hybrid}.*
    PYTHONPATH=$PWD python examples/trace_emulated.py --out /tmp/t --micro-batches 4
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import dapple
import dapple.cli
from dapple.models import EmulatedNet
from dapple.planner import Stage
from dapple.profiler import trace_layers

PLANS = {  # name -> (schedule, stages as (layers, devices)); EmulatedNet layers: layers.0-3, head
    "dapple": ("dapple", [((0, 1), [0]), ((1, 2), [1]), ((2, 3), [2]), ((3, 5), [3])]),
    "gpipe": ("gpipe", [((0, 1), [0]), ((1, 2), [1]), ((2, 3), [2]), ((3, 5), [3])]),
    "hybrid": ("dapple", [((0, 2), [0, 1]), ((2, 3), [2]), ((3, 5), [3])]),
}


def run(args: argparse.Namespace) -> list[str]:
    """On every rank: build each plan's pipeline, warm it up, trace ``args.steps`` step(s), save on rank 0."""
    torch.set_num_threads(1)
    b, m = args.micro_batch, args.micro_batches
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(b * m, 16, generator=gen), torch.randint(0, 4, (b * m,), generator=gen)
    written = []
    for name in args.plans:
        schedule, stages = PLANS[name]
        torch.manual_seed(0)
        model = EmulatedNet([args.ms_per_row] * 4, width=16)
        plan = dapple.Plan(global_batch_size=b * m, micro_batch_size=b, schedule=schedule,
                           stages=[Stage(*s) for s in stages], layer_names=trace_layers(model).names)
        pipe = dapple.pipeline(model, plan, F.cross_entropy, timeout=120)
        for _ in range(args.warmup):
            pipe.train_step(x, y)
        with pipe.trace() as t:
            for _ in range(args.steps):
                pipe.train_step(x, y)
        path = t.save(os.path.join(args.out, f"trace_{name}.json"))  # collective; rank 0 writes
        if path is not None:
            written.append(str(path))
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs", help="directory for trace_<plan>.json/.png (default: docs)")
    p.add_argument("--plans", nargs="+", choices=sorted(PLANS), default=list(PLANS))
    p.add_argument("--ms-per-row", type=float, default=1.0, help="emulated forward ms per row (backward 2x)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--steps", type=int, default=1, help="traced steps (default 1)")
    p.add_argument("--warmup", type=int, default=2, help="untraced steps first (default 2)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for path in dapple.runtime.launch(run, 4, args)[0]:
        dapple.cli.main(["show", path, "--png", path[:-len(".json")] + ".png"])


if __name__ == "__main__":
    main()
