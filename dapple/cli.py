"""The ``dapple`` command line: a thin layer over the public API (profile, plan, simulate, show, demo)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

Adder = Callable[["argparse._SubParsersAction"], None]


def _add_show(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("show", help="print a Profile, Cluster or Plan YAML document")
    p.add_argument("path", help="a dapple YAML document")
    p.set_defaults(run=_run_show)


def _run_show(args: argparse.Namespace) -> int:
    import yaml

    from . import Cluster, Plan, Profile

    with open(args.path) as f:
        head = yaml.safe_load(f) or {}
    kinds = {"dapple_plan": Plan, "dapple_profile": Profile, "dapple_cluster": Cluster}
    for key, cls in kinds.items():
        if isinstance(head, dict) and key in head:
            print(cls.load(args.path))
            return 0
    raise SystemExit(f"dapple show: {args.path} is not a dapple document (expected one of {sorted(kinds)})")


def _load_profile(path: str, batch: int | None):
    from . import Profile

    if str(path).endswith(".txt"):  # a PipeDream graph.txt
        if batch is None:
            raise SystemExit(f"dapple: {path} is a PipeDream profile; give the batch size it was profiled at "
                             f"with --profile-batch")
        return Profile.from_pipedream(path, batch)
    return Profile.load(path)


def _load_cluster(spec: str):
    from . import Cluster

    if spec.upper() in ("A", "B", "C"):
        return Cluster.preset(spec)
    return Cluster.load(spec)


def _add_plan(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("plan", help="plan stages, replication and placement for a profile on a cluster")
    p.add_argument("profile", help="a dapple profile YAML, or a PipeDream graph.txt (with --profile-batch)")
    p.add_argument("--cluster", required=True, help="preset A, B or C (paper Table 3) or a cluster YAML")
    p.add_argument("--global-batch", type=int, required=True, help="samples per training iteration")
    p.add_argument("--micro-batch", type=int, default=None, help="micro-batch size (default: searched)")
    p.add_argument("--profile-batch", type=int, default=None, help="batch size a PipeDream profile was taken at")
    p.add_argument("--model", choices=("refined", "paper"), default="refined", help="latency model")
    p.add_argument("--overlap", action="store_true", help="the runtime overlaps AllReduce with the last backward")
    p.add_argument("--max-stages", type=int, default=None, help="limit the pipeline depth")
    p.add_argument("--schedule", choices=("dapple", "gpipe"), default="dapple")
    p.add_argument("-o", "--output", default=None, help="write the plan YAML here")
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from .planner import plan

    prof = _load_profile(args.profile, args.profile_batch)
    result = plan(prof, _load_cluster(args.cluster), args.global_batch, args.micro_batch, model=args.model,
                  overlap=args.overlap, max_stages=args.max_stages, schedule=args.schedule)
    print(result)
    if args.output:
        result.save(args.output)
        print(f"wrote {args.output}")
    return 0


def _add_simulate(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("simulate", help="play a plan's iteration in the event simulator; compare with the estimate")
    p.add_argument("plan", help="a plan YAML")
    p.add_argument("--profile", required=True, help="the profile the plan was made for (YAML or PipeDream .txt)")
    p.add_argument("--profile-batch", type=int, default=None, help="batch size a PipeDream profile was taken at")
    p.add_argument("--cluster", required=True, help="preset A, B or C or a cluster YAML")
    p.add_argument("--overlap", action="store_true", help="overlap AllReduce with the last backward (DDP-style)")
    p.add_argument("--schedule", choices=("dapple", "gpipe"), default=None, help="default: the plan's")
    p.set_defaults(run=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    from . import Plan
    from .planner import evaluate, simulate

    plan = Plan.load(args.plan)
    prof = _load_profile(args.profile, args.profile_batch)
    cluster = _load_cluster(args.cluster)
    schedule = args.schedule or plan.schedule
    sim = simulate(plan, prof, cluster, overlap=args.overlap, schedule=schedule)
    print(sim)
    for model in ("refined", "paper"):
        est = evaluate(prof, cluster, plan.stages, plan.global_batch_size, plan.micro_batch_size, schedule=schedule,
                       warmup_policy=plan.warmup_policy, model=model, overlap=args.overlap).latency_ms
        print(f"  {model} model estimate: {est:.3f} ms ({(est - sim.latency_ms) / sim.latency_ms:+.1%} vs simulated "
              f"{sim.latency_ms:.3f} ms)")
    return 0


COMMANDS: list[Adder] = [_add_show, _add_plan, _add_simulate]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dapple", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
