"""Per-rank function for the tracing tests: traced dapple and gpipe steps on 3 ranks with skewed clocks."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.nn.functional as F

import dapple
from dapple.runtime import tracing
from tests.runtime.workers import Chain, _chain_data, _plan

SKEW = {0: 0.0, 1: 5.0, 2: -3.0}  # seconds added to each rank's trace clock: servers with different clocks
STAGES = [((0, 2), [0, 1]), ((2, 5), [2])]  # 2 stages, stage 0 replicated: split-concat and an AllReduce


def run_traces(out_dir: str) -> dict[str, Any]:
    """dapple M=4 traced with ``pipe.trace()``, gpipe M=4 with ``trace=True`` over 2 steps; both saved."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    skew = SKEW[rank]
    tracing.CLOCK = lambda: time.perf_counter() + skew
    made = []
    init = tracing.Recorder.__init__

    def counted(self, *a, **kw):
        made.append(1)
        init(self, *a, **kw)
    tracing.Recorder.__init__ = counted
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    model = Chain().double()
    x, y = _chain_data(8)
    pipe = dapple.pipeline(model, _plan(model, STAGES, 8, 2), F.cross_entropy, timeout=30)
    pipe.train_step(x, y)  # tracing off: no recorder may exist, the engine must not have been handed one
    out["recorders_when_off"] = len(made)
    out["rec_when_off"] = [pipe.recorder is None, pipe._p2p.rec is None, pipe._reducer.rec is None]
    try:
        pipe.save_trace(os.path.join(out_dir, "never.json"))
        out["save_trace_when_off"] = "no error"
    except RuntimeError as e:
        out["save_trace_when_off"] = str(e)
    with pipe.trace() as t:
        pipe.train_step(x, y)
    n = len(t.events)
    pipe.train_step(x, y)  # after the block: not recorded
    out["events_after_exit"] = len(t.events) - n
    out["rec_after_exit"] = [pipe.recorder is None, pipe._p2p.rec is None, pipe._reducer.rec is None]
    out["local_starts"] = [e.start for e in t.events]  # this rank's own (skewed) clock
    out["dapple"] = str(t.save(os.path.join(out_dir, "dapple.json")))

    torch.manual_seed(0)
    model = Chain().double()
    gp = dapple.pipeline(model, _plan(model, STAGES, 8, 2, schedule="gpipe"), F.cross_entropy, timeout=30,
                         trace=True)
    gp.train_step(x, y)
    gp.train_step(x, y)
    out["gpipe"] = str(gp.save_trace(os.path.join(out_dir, "gpipe.json")))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipe.train_step(x, y)  # the ops as torch.profiler (and Nsight, Perfetto) show them
    out["profiler_ranges"] = sorted({e.name for e in prof.events() if e.name[:1] in "FBsrAl"
                                     and e.name.split(" ")[0] in ("F0", "F3", "B0", "B3", "send", "recv",
                                                                  "AllReduce", "loss")})
    return out
