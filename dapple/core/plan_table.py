"""``print(plan)``: a readable table of stages, devices, K_i, per-stage costs and the latency estimate."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .plan import Estimate, Plan


def _short(name: str, width: int = 24) -> str:
    """``name`` in at most ``width`` characters: its last dotted parts, which tell layers apart
    (``encoder.layers.encoder_layer_11`` -> ``~layers.encoder_layer_11``)."""
    if len(name) <= width:
        return name
    parts = name.split(".")
    tail = parts[-1]
    for part in reversed(parts[:-1]):
        if len(part) + 1 + len(tail) > width - 1:
            break
        tail = f"{part}.{tail}"
    return "~" + tail[-(width - 1):]


def _layer_span(plan: "Plan", lo: int, hi: int) -> str:
    names = plan.layer_names
    if not names:
        return f"[{lo}, {hi})"
    first, last = _short(names[lo]), _short(names[hi - 1])
    return f"[{lo}, {hi}) {first}" if hi - lo == 1 else f"[{lo}, {hi}) {first} .. {last}"


def format_plan(plan: "Plan") -> str:
    """``str(plan)``: a header, a table of the stages, the estimate and how the plan was made.

    Args:
        plan: the plan; its ``estimate`` and ``meta`` add lines when present.
    """
    est = plan.estimate
    details = est.details if est is not None else {}
    per_stage = details.get("stages") or []
    lines = [_head(plan)] + _table(plan, per_stage)
    if per_stage:
        rc = ("; recompute: the stage runs its forward again in its backward (in B): yes, all of it; layers, one "
              "layer at a time; selective, all but its matmuls, convolutions and attention") if any(
            s.recompute for s in plan.stages) else ""
        lines.append("  (F/B: one micro-batch slice on the slowest replica; AR: gradient AllReduce over the stage's "
                     f"devices; send: activations to the next stage, gradients take as long back{rc})")
    if est is not None:
        lines += _estimate_lines(est, details)
    if plan.meta.get("planning_time_s") is not None:
        lines += _planning_lines(plan)
    return "\n".join(lines)


def _head(plan: "Plan") -> str:
    layout = plan.chunks
    chunks = (f" as {layout.chunks} chunks on each of {len(layout.groups)} device group(s), {plan.placement} order,"
              if layout.chunks > 1 else "")
    head = (f"dapple plan: {plan.num_stages} stage(s){chunks} on {plan.num_devices} device(s), "
            f"global batch {plan.global_batch_size} = {plan.num_micro_batches} micro-batches x "
            f"{plan.micro_batch_size}, schedule {plan.schedule}, warmup policy {plan.warmup_policy}")
    if plan.mixed_precision:
        head += f", mixed precision {plan.mixed_precision}"
    if plan.shard_optimizer:
        head += ", optimizer state sharded over each stage's replicas"
    if plan.meta.get("model"):
        head += f", model {plan.meta['model']}"
    if plan.meta.get("cluster"):
        head += f", cluster {plan.meta['cluster']}"
    return head


def _table(plan: "Plan", per_stage: list) -> list[str]:
    """The stage table's lines: a header row, a rule, a row per stage (its estimated costs where known)."""
    layout = plan.chunks
    chunked = layout.chunks > 1  # a chunk column only where device groups hold several (older tables unchanged)
    rows = [("stage", "layers", "devices") + (("chunk",) if chunked else ()) +
            ("K_i", "F ms", "B ms", "AR ms", "send ms", "mem GB")]
    marks = any(s.recompute for s in plan.stages)  # a column only where some stage recomputes (older tables unchanged)
    if marks:
        rows[0] += ("recompute",)
    for i, s in enumerate(plan.stages):
        d = per_stage[i] if i < len(per_stage) else {}

        def num(key: str, fmt: str = "{:.3f}") -> str:
            return fmt.format(d[key]) if key in d else "-"

        chunk = (f"{layout.chunk_of(i)} of {layout.chunks}",) if chunked else ()
        rows.append((str(i), _layer_span(plan, *s.layers), f"{device_ranges(s.devices)} (x{len(s.devices)})", *chunk,
                     str(s.warmup), num("forward_ms"), num("backward_ms"), num("allreduce_ms"),
                     num("send_forward_ms"), num("memory_gb", "{:.2f}")) + ((_recompute_mark(s.recompute),)
                                                                              if marks else ()))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
        if k == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return lines


def _estimate_lines(est: "Estimate", details: dict) -> list[str]:
    """Latency = Tw + Ts + Te and the pivot; then bubble fraction, ACR and overlap where known."""
    model = f" ({details['model']} model)" if details.get("model") else ""
    pivot = details.get("pivot", "")
    where = f"pivot stage Q = {est.pivot_stage}" + (f" ({pivot})" if pivot.startswith("comm") else "")
    lines = [f"estimate{model}: latency {est.latency_ms:.3f} ms = warmup Tw {est.warmup_ms:.3f} + steady Ts "
             f"{est.steady_ms:.3f} + ending Te {est.ending_ms:.3f}; {where}"]
    extra = []
    if "bubble_fraction" in details:
        extra.append(f"bubble fraction {details['bubble_fraction']:.1%}")
    if "acr" in details:
        extra.append(f"activation communication ratio {details['acr']:.3f}")
    if details.get("overlap"):
        extra.append("AllReduce overlapped with the last backward")
    if extra:
        lines.append("  " + "; ".join(extra))
    return lines


def _planning_lines(plan: "Plan") -> list[str]:
    """Who planned it, how long it took, how the search ran, and how close to the best it is known to be."""
    meta = plan.meta
    lines = [f"planned by {meta.get('planner', '?')} in {meta['planning_time_s']:.3f} s"
             + (f"; placement {', '.join(meta['placement'])}" if meta.get("placement") else "")
             + ("; compact search (partly used servers kept alike)" if meta.get("search") == "compact" else "")
             + (f"; search stopped at its time limit{_limit(meta.get('time_limit_s'))}: the best "
                f"plan found so far (time_limit= searches longer)" if meta.get("search_complete") is False else "")
             + (f"; optimality gap {meta['gap']:.1%}" if meta.get("gap") else "")]
    searched = meta.get("search_schedule")
    if plan.chunks.chunks > 1:
        lines.append(f"  the search models one stage per device group under the {searched or 'dapple'} schedule; "
                     f"these chunks were not searched: no lower bound or optimality is claimed")
    elif searched and searched != plan.schedule:  # the search's bound is one of the 1F1B model: none is claimed here
        lines.append(f"  the search models the {searched} schedule; the simulator judged its candidates under "
                     f"{plan.schedule}: no lower bound is claimed")
    bound = meta.get("latency_lower_bound_ms")
    if bound and plan.estimate is not None:
        off = plan.estimate.latency_ms / bound - 1
        lines.append(f"  no plan on all {plan.num_devices} devices is modelled below {bound:.1f} ms: " + (
            "this one is the model's best" if off < 5e-5 else f"this one is within {off:.1%} of the best possible"))
    return lines + _chunk_lines(plan)


def _chunk_lines(plan: "Plan") -> list[str]:
    """What ``dapple.plan`` tried of two chunks per device group (``meta["schedule_choice"]["chunked"]``)."""
    choice = plan.meta.get("schedule_choice")
    if not isinstance(choice, dict) or not choice.get("chunked"):
        return []
    tried = choice["chunked"]
    ran = [f"{t['schedule']} on {t['layout']} {t['simulated_ms']:.3f} ms" for t in tried if "simulated_ms" in t]
    refused = [f"{t['schedule']} on {t['layout']}: {t['refused']}" for t in tried if "refused" in t]
    verdict = ("this plan simulated fastest" if plan.chunks.chunks > 1
               else "none simulated faster than this plan" if ran else "none was simulated")
    own = choice.get("simulated_ms")
    if isinstance(own, dict) and own:
        verdict += "; one stage per device group: " + ", ".join(f"{k} {v:.3f} ms" for k, v in own.items())
    return ([f"  two chunks per device group (the search's device groups and one device per group, the layers re-cut "
             f"to balance each chunk's compute and transfers; simulated, not searched): {verdict}"]
            + ([f"    simulated: {'; '.join(ran)}"] if ran else [])
            + ([f"    not tried: {'; '.join(refused)}"] if refused else []))


def _limit(seconds: object) -> str:
    """" (60 s)" for a plan's ``meta["time_limit_s"]``, "" when it has none."""
    return f" ({seconds:g} s)" if isinstance(seconds, (int, float)) else ""


def device_ranges(devices: Sequence[int]) -> str:
    """Compact device list: [0, 1, 2, 3, 7] -> "0-3,7"."""
    ds = sorted(devices)
    parts, i = [], 0
    while i < len(ds):
        j = i
        while j + 1 < len(ds) and ds[j + 1] == ds[j] + 1:
            j += 1
        parts.append(f"{ds[i]}" if i == j else f"{ds[i]}-{ds[j]}")
        i = j + 1
    return ",".join(parts)


def _recompute_mark(mode: object) -> str:
    """A stage's recompute column: "no", "yes" (the whole stage), or its mode ("layers", "selective")."""
    return "yes" if mode is True else "no" if not mode else str(mode)
