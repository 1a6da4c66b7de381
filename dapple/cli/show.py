"""``dapple show``: print a document, draw a plan's simulated schedule or a measured trace."""

from __future__ import annotations

import argparse

from .. import Cluster, Plan, Profile
from ..core import documents
from ..core.cluster import VERSION as CLUSTER_VERSION
from ..core.plan import VERSION as PLAN_VERSION
from ..core.profile import VERSION as PROFILE_VERSION
from ..core.timeline import from_chrome_trace, process_names, read_chrome_trace, save_chrome_trace, summarize
from ..planner import draw_plan, simulate
from ..planner.simulator.events import from_simulation
from ..planner.simulator.gantt import device_labels, draw_gantt
from .inputs import plan_inputs


def add_show(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("show", help="print a Profile, Cluster or Plan YAML document, or summarise a trace JSON")
    p.add_argument("path", help="a dapple YAML document, or a Chrome-trace .json written by a traced pipeline")
    p.add_argument("--png", default=None, metavar="PNG",
                   help="draw the timeline (ranks x time) here: a trace's measured one, or a plan's simulated one")
    p.add_argument("--profile", default=None,
                   help="plan --png: the profile to play it on (default: the one recorded in the plan)")
    p.add_argument("--profile-batch", type=int, default=None, help="batch size a PipeDream profile was taken at")
    p.add_argument("--cluster", default=None,
                   help="plan --png: preset A, B or C, or a cluster YAML (default: the plan's own)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="plan --png: AllReduce overlapped with the last backward (default: as the plan was made)")
    p.add_argument("--json", default=None, metavar="JSON", help="plan: also write the simulated Chrome trace here")
    p.set_defaults(run=_run_show)


def _run_show(args: argparse.Namespace) -> int:
    if str(args.path).endswith(".json"):
        return _show_trace(args.path, args.png)
    kinds: dict[str, tuple[type[Plan] | type[Profile] | type[Cluster], int]] = {
        "dapple_plan": (Plan, PLAN_VERSION), "dapple_profile": (Profile, PROFILE_VERSION),
        "dapple_cluster": (Cluster, CLUSTER_VERSION)}
    head = documents.read(args.path, "dapple", f"one of the headers {sorted(kinds)}")
    key = next((k for k in kinds if k in head), None)
    if key is None:
        raise SystemExit(f"dapple show: {args.path} is not a dapple document (expected one of {sorted(kinds)})")
    cls, version = kinds[key]
    documents.check_header(head, args.path, key, version)
    doc = cls.from_dict(head, where=str(args.path))
    print(doc)
    if key == "dapple_plan" and (args.png or args.json):
        return _show_simulated(doc, args)
    if args.png:
        raise SystemExit(f"dapple show: --png draws a trace (.json) or a plan; {args.path} is a {key[7:]} document")
    return 0


def _show_simulated(plan, args: argparse.Namespace) -> int:
    """Draw (and/or save as a Chrome trace) the simulated schedule of ``plan`` on its profile and cluster."""
    prof, cluster = plan_inputs(plan, args.path, args.profile, args.profile_batch, args.cluster, "show")
    if args.png:
        sim = draw_plan(plan, prof, cluster, args.png, overlap=args.overlap)
        print(f"{sim}\nwrote {args.png}")
    else:
        sim = simulate(plan, prof, cluster, overlap=args.overlap)
    if args.json:
        save_chrome_trace(from_simulation(sim), args.json, metadata={"simulated": True, "plan": plan.to_dict()},
                          process_names=device_labels(sim))
        print(f"wrote {args.json}")
    return 0


def _show_trace(path: str, png: str | None) -> int:
    """Print a measured trace's per-rank summary and (``png``) draw its timeline."""
    try:
        doc = read_chrome_trace(path)
        events = from_chrome_trace(doc, where=path)
    except ValueError as e:
        raise SystemExit(f"dapple show: {e}") from None
    if not events:
        raise SystemExit(f"dapple show: {path} holds no events")
    meta = doc.get("otherData") or {}
    names = process_names(doc)
    steps = meta.get("steps")
    which = _which_steps(steps)
    head = f"trace {path}: {len(names) or len({e.rank for e in events})} rank(s), {len(events)} events"
    if meta.get("schedule"):
        head += (f", schedule {meta['schedule']}, {meta.get('num_micro_batches')} micro-batches x "
                 f"{meta.get('micro_batch_size')}, {which}")
    print(head + (f"; ms summed over the {len(steps)} steps" if steps and len(steps) > 1 else ""))
    print(f"{'rank':<28}{'step ms':>9}{'fwd ms':>9}{'bwd ms':>9}{'idle ms':>9}{'AR ms':>8}{'busy':>7}")
    for r, d in summarize(events).items():
        print(f"{names.get(r, f'rank {r}'):<28}{d['span_ms']:>9.1f}{d['forward_ms']:>9.1f}{d['backward_ms']:>9.1f}"
              f"{d['idle_ms']:>9.1f}{d['allreduce_ms']:>8.1f}{d['busy']:>7.0%}")
    if png:
        title = f"{path}: measured"
        if meta.get("schedule") and steps:
            stages = f"{meta['num_stages']} stage{'s' if meta['num_stages'] != 1 else ''}"
            title = (f"{meta['schedule']} schedule, measured: {stages}, "
                     f"M={meta['num_micro_batches']} micro-batches of {meta['micro_batch_size']} rows, {which}")
        draw_gantt(events, png, title=title, rank_labels=names)
        print(f"wrote {png}")
    return 0


def _which_steps(steps: list[int] | None) -> str:
    """"step 3", "steps 3-5" or "steps [3, 7]": the training steps a trace recorded."""
    if not steps:
        return ""
    if len(steps) == 1:
        return f"step {steps[0]}"
    contiguous = steps == list(range(steps[0], steps[0] + len(steps)))
    return f"steps {steps[0]}-{steps[-1]}" if contiguous else f"steps {steps}"
