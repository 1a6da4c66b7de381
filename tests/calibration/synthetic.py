"""Traces as the runtime records them, made from the simulator's iteration of a plan on "true" documents."""

from __future__ import annotations

import dapple
from dapple.core.timeline import Event

NAMES = {"F": "forward", "B": "backward", "W": "backward"}


def simulated_trace(plan: dapple.Plan, profile: dapple.Profile, cluster: dapple.Cluster, steps: int = 3,
                    tail_ms: float = 0.0) -> tuple[list[Event], dict]:
    """``steps`` copies of the simulated iteration (AllReduce overlapped) as ``Trace.gather()`` would return them:
    F/B/W ops with idle spans between them, each send posted as the receiver starts waiting, AllReduce buckets from
    their start, one step span per rank, ``tail_ms`` longer than the simulated step (the runtime's end of step)."""
    sim = dapple.simulate(plan, profile, cluster, overlap=True)
    events: list[Event] = []
    period = (sim.latency_ms + tail_ms + 10.0) / 1e3
    for step in range(1, steps + 1):
        t0 = step * period
        for o in sim.ops:
            at = t0 + o.start_ms / 1e3
            if o.kind in NAMES:
                args = {"step": step, **({"part": "weight"} if o.kind == "W" else {})}
                events.append(Event(o.device, NAMES[o.kind], f"{o.kind}{o.micro_batch}", at,
                                    at + o.duration_ms / 1e3, o.micro_batch, args))
        for i, st in enumerate(plan.stages):  # AllReduce buckets, in order, on every replica
            ars = sorted((o for o in sim.ops if o.kind == "AR" and o.stage == i), key=lambda o: o.start_ms)
            for k, o in enumerate(o for o in ars if o.device == st.devices[0]):
                for d in st.devices:
                    events.append(Event(d, "allreduce", f"AR bucket {k}", t0 + o.start_ms / 1e3,
                                        t0 + o.end_ms / 1e3, None,
                                        {"lane": "allreduce", "group": f"stage {i} replicas", "ranks": list(st.devices),
                                         "bytes": o.nbytes, "step": step}))
        for t in sim.transfers:
            what = "activations" if t.kind == "send_F" else "gradients"
            common = {"bytes": t.nbytes, "what": what, "rows": [0, t.rows], "step": step}
            at = t0 + t.start_ms / 1e3
            events.append(Event(t.device, "send", f"send→{t.peer}", at, at + 1e-6, t.micro_batch,
                                {**common, "peer": t.peer}))
            events.append(Event(t.peer, "recv", f"recv←{t.device}", at, t0 + t.end_ms / 1e3, t.micro_batch,
                                {**common, "peer": t.device}))
        for d in sim.stage_of_device:
            events.append(Event(d, "other", f"step {step}", t0, t0 + (sim.latency_ms + tail_ms) / 1e3, None,
                                {"lane": "step", "step": step}))
            ops = sorted((o for o in sim.ops if o.device == d and o.kind in NAMES), key=lambda o: o.start_ms)
            for a, b in zip(ops, ops[1:]):  # waits between ops, as the runtime records them
                if b.start_ms > a.end_ms:
                    events.append(Event(d, "idle", "idle", t0 + a.end_ms / 1e3, t0 + b.start_ms / 1e3, None,
                                        {"step": step, "waiting_for": "receives"}))
    return events, {"plan": plan.to_dict()}

