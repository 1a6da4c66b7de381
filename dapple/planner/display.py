"""``print(plan)``: a readable table of stages, devices, K_i, per-stage costs and the latency estimate."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Plan


def _layer_span(plan: "Plan", lo: int, hi: int) -> str:
    names = plan.layer_names
    if not names:
        return f"[{lo}, {hi})"
    first, last = names[lo], names[hi - 1]
    return f"[{lo}, {hi}) {first}" if hi - lo == 1 else f"[{lo}, {hi}) {first} .. {last}"


def format_plan(plan: "Plan") -> str:
    from .plan import device_ranges

    est = plan.estimate
    per_stage = (est.details.get("stages") if est is not None else None) or []
    head = (f"dapple plan: {plan.num_stages} stage(s) on {plan.num_devices} device(s), "
            f"global batch {plan.global_batch_size} = {plan.num_micro_batches} micro-batches x "
            f"{plan.micro_batch_size}, schedule {plan.schedule}, warmup policy {plan.warmup_policy}")
    if plan.meta.get("model"):
        head += f", model {plan.meta['model']}"
    rows = [("stage", "layers", "devices", "K_i", "F ms", "B ms", "AR ms")]
    for i, s in enumerate(plan.stages):
        d = per_stage[i] if i < len(per_stage) else {}

        def ms(key: str) -> str:
            return f"{d[key]:.3f}" if key in d else "-"

        rows.append((str(i), _layer_span(plan, *s.layers), f"{device_ranges(s.devices)} (x{len(s.devices)})",
                     str(s.warmup), ms("forward_ms"), ms("backward_ms"), ms("allreduce_ms")))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [head]
    for k, r in enumerate(rows):
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
        if k == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    if est is not None:
        tail = (f"estimate: latency {est.latency_ms:.3f} ms = warmup Tw {est.warmup_ms:.3f} + steady Ts "
                f"{est.steady_ms:.3f} + ending Te {est.ending_ms:.3f}; pivot stage Q = {est.pivot_stage}")
        if "bubble_fraction" in est.details:
            tail += f"; bubble fraction {est.details['bubble_fraction']:.1%}"
        lines.append(tail)
    return "\n".join(lines)
