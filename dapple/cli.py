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


COMMANDS: list[Adder] = [_add_show]


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
