"""The ``dapple`` command line: a thin layer over the public API (profile, plan, simulate, show, probe, demo)."""

from __future__ import annotations

import argparse
import os
from typing import Sequence

from ..core.version import VERSION
from .commands import COMMANDS
from .inputs import load_example
from .show import add_show

__all__ = ["DISTRIBUTION", "build_parser", "load_example", "main"]

DISTRIBUTION = "dapple-pipeline"  # the name pip knows us by ("dapple" on PyPI is another project); import dapple


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dapple", description=__doc__,
                                     epilog=f"dapple {VERSION}, installed as {DISTRIBUTION} "
                                            f"(pip install {DISTRIBUTION}; import dapple)")
    parser.add_argument("--version", action="version", version=f"dapple {VERSION} ({DISTRIBUTION})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in [add_show, *COMMANDS]:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; bad input (a ValueError naming the value, a file that cannot be read) ends it with that
    message on stderr and exit status 1, no traceback (``DAPPLE_DEBUG=1`` shows it)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ValueError, OSError) as e:
        if os.environ.get("DAPPLE_DEBUG"):
            raise
        raise SystemExit(f"dapple {args.command}: {e}") from e

