"""The `sleuth` command: parses arguments, calls the layer below, prints results.

Each subcommand lives in its own module here with `register(subparsers)`, which adds its parser
and sets `func(args) -> int`. Results go to stdout, progress and errors to stderr.
A UserError anywhere below becomes one line `sleuth: error: ...` and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sleuth import __version__
from sleuth.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    # Imported here so `sleuth --help` stays fast and each command pays only for its own imports.
    from sleuth.cli import eval, export, puzzles, report, serve, train

    parser = argparse.ArgumentParser(prog="sleuth", description="RL on verifiable tasks for open LLMs.")
    parser.add_argument("--version", action="version", version=f"sleuth {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (puzzles, report, train, eval, export, serve):
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"sleuth: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sleuth: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
