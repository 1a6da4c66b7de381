"""Helpers of estimate_vs_measured.py: where a traced step's time went against the cost model, and pictures."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dapple


def step_lengths_ms(events: list) -> dict:
    """Per traced step: ms from its first event's start to its last event's end, over all ranks."""
    steps = sorted({e.args.get("step") for e in events})
    return {s: (max(e.end for e in events if e.args.get("step") == s)
                - min(e.start for e in events if e.args.get("step") == s)) * 1e3 for s in steps}


# ---- where the time went (from the traces) ---------------------------------------------------------------
def diagnose(plan: dapple.Plan, events: list, prof: dapple.Profile, cluster: dapple.Cluster) -> dict:
    """Medians over the traced steps: per-op time / profile, AllReduce / model and replica skew before it,
    P2P delivery vs the cluster fit, runtime time between ops, and the traced step."""
    from dapple.core.split_concat import slice_bounds
    from dapple.core.timeline import lane_of
    from dapple.planner.model.cost import CostModel, layout_of

    med = statistics.median
    cm = CostModel(prof, cluster, plan.micro_batch_size)
    steps = sorted({e.args.get("step") for e in events})
    ratios, ar_meas, ar_model, skews, gaps = [], [], [], [], []
    for i, st in enumerate(plan.stages):
        for k, d in enumerate(st.devices):
            lo, hi = slice_bounds(plan.micro_batch_size, st.replicas)[k]
            f, b = cm.compute_rows(st.layers[0], st.layers[1], hi - lo)
            ratios += [e.duration * 1e3 / (f if e.kind == "forward" else b) for e in events
                       if e.rank == d and e.kind in ("forward", "backward")]
        if st.replicas > 1:
            for s in steps:
                bucket = [e for e in events if e.rank in st.devices and e.args.get("step") == s
                          and e.name.startswith("AR bucket")]
                if bucket:
                    last_launch = max(e.start for e in bucket)
                    ar_meas.append((max(e.end for e in bucket) - last_launch) * 1e3)
                    skews.append((last_launch - min(e.start for e in bucket)) * 1e3)
                    ar_model.append(cm.allreduce(st.layers[0], st.layers[1], layout_of(cluster, st.devices)))
    sends = {(e.rank, e.args["peer"], e.args["what"], e.micro_batch, e.args["step"], tuple(e.args["rows"])): e
             for e in events if e.kind == "send"}
    delivery = []
    for e in events:  # receives whose rank was already waiting when the matching isend was posted
        s = sends.get((e.args.get("peer"), e.rank, e.args.get("what"), e.micro_batch, e.args.get("step"),
                       tuple(e.args.get("rows", ()))))
        if e.kind == "recv" and s is not None and e.start < s.start:
            delivery.append((e.end - s.start) * 1e3)
    for r in {e.rank for e in events}:
        for s in steps:
            mine = sorted((e for e in events if e.rank == r and e.args.get("step") == s), key=lambda e: e.start)
            comp = [e for e in mine if lane_of(e) == "compute"]
            span = [e for e in mine if lane_of(e) == "step"]
            ops = sum(1 for e in comp if e.kind in ("forward", "backward"))
            if comp and span and ops:
                covered = sum(e.duration for e in comp)  # compute-lane events never overlap
                gaps.append((span[0].duration - covered) * 1e3 / ops)
    step_ms = list(step_lengths_ms(events).values())
    p2p_model = cm.route_ms(0, plan.micro_batch_size // plan.stages[0].replicas, 0, 0) if plan.num_stages > 1 else None
    return {"op_over_profile": med(ratios), "allreduce_ms": med(ar_meas) if ar_meas else None,
            "allreduce_model_ms": med(ar_model) if ar_model else None, "skew_ms": med(skews) if skews else None,
            "delivery_ms": med(delivery) if delivery else None, "delivery_model_ms": p2p_model,
            "gap_per_op_ms": med(gaps) if gaps else None, "traced_step_ms": med(step_ms)}


# ---- pictures --------------------------------------------------------------------------------------------
def side_by_side(trace_path: Path, plan: dapple.Plan, prof: dapple.Profile, cluster: dapple.Cluster,
                 out: Path, title: str) -> Path:
    """One measured step (the trace's median-length one) above the simulated iteration, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from dapple.core.timeline import load_chrome_trace
    from dapple.planner.simulator.events import from_simulation
    from dapple.planner.simulator.gantt import draw_gantt

    events = load_chrome_trace(trace_path)
    length = step_lengths_ms(events)  # ms
    step = sorted(length, key=length.__getitem__)[len(length) // 2]
    one = [e for e in events if e.args.get("step") == step]
    sim = dapple.simulate(plan, prof, cluster)
    labels = {d: f"rank {d} · stage {i}" for i, st in enumerate(plan.stages) for d in st.devices}
    span = max(length[step], sim.latency_ms)  # one time scale for both
    with tempfile.TemporaryDirectory() as tmp:
        top = draw_gantt(one, Path(tmp) / "measured.png", rank_labels=labels, span_ms=span,
                         title=f"{title}: measured step ({length[step]:.0f} ms, traced)")
        bottom = draw_gantt(from_simulation(sim), Path(tmp) / "simulated.png", rank_labels=labels, span_ms=span,
                            title=f"{title}: simulated ({sim.latency_ms:.0f} ms, dapple.simulate)")
        a, b = plt.imread(top), plt.imread(bottom)
    width = max(a.shape[1], b.shape[1])
    pad = [np.pad(x, ((0, 0), (0, width - x.shape[1]), (0, 0)), constant_values=1.0) for x in (a, b)]
    plt.imsave(out, np.concatenate(pad, axis=0))
    return out


# ---- the layers' own real compute when ranks share cores ---------------------------------------------------
def contention(make_model, batch, world: int, rows_list: tuple[int, ...] = (1, 2, 4)) -> dict:
    """On every rank: the whole model's forward/backward at ``rows`` rows with 1 .. ``world`` ranks at once."""
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    r, out = dist.get_rank(), {}
    for rows in rows_list:
        m, (x, y) = make_model(), batch(rows)
        for k in range(1, world + 1):
            dist.barrier()
            if r < k:
                ts = []
                for i in range(12):
                    t0 = time.perf_counter()
                    loss = F.cross_entropy(m(x), y)
                    t1 = time.perf_counter()
                    loss.backward()
                    if i >= 2:
                        ts.append((t1 - t0, time.perf_counter() - t1))
                out[(rows, k)] = tuple(statistics.median(v[j] for v in ts) * 1e3 for j in (0, 1))
            dist.barrier()
    return out
