"""The `sleuth` command: parses arguments, calls the layer below, prints results.

Each subcommand lives in its own module here with `register(subparsers)`, which adds its parser
and sets `func(args) -> int`. Results go to stdout, progress and errors to stderr.
A UserError anywhere below becomes one line `sleuth: error: ...` and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from sleuth import __version__
from sleuth.errors import UserError
from sleuth.system.fsio import describe_os_error
from sleuth.system.logs import configure_logging


def build_parser() -> argparse.ArgumentParser:
    # Imported here so `sleuth --help` stays fast and each command pays only for its own imports.
    from sleuth.cli import eval, export, puzzles, report, serve, sft, train

    parser = argparse.ArgumentParser(prog="sleuth", description="RL on verifiable tasks for open LLMs.")
    parser.add_argument("--version", action="version", version=f"sleuth {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (puzzles, report, sft, train, eval, export, serve):
        module.register(sub)
    for command in sub.choices.values():
        command.add_argument("--verbose", action="store_true",
                             help="show the libraries' own logs (vLLM, transformers) too; also SLEUTH_LOG=debug")
    return parser


_terminated = False
"""Set by SIGTERM: whatever the command then fails with is the interrupt's doing."""


def _inside_import(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _terminate(signum: int, frame: FrameType | None) -> None:
    # SIGTERM (schedulers, `docker stop`) ends a command the way Ctrl-C does; `sleuth train`
    # installs its own handler that checkpoints first.
    global _terminated
    _terminated = True
    if _inside_import(frame):
        # An exception raised in the middle of an import can land in a native library's start-up
        # and leave it broken: seen on `sleuth train` stopped ~1-2 s after launch, a Rust extension
        # aborting the process (SIGABRT) or the interpreter exiting by SIGINT after printing that it
        # was interrupted. End the way SIGTERM ends a process without a handler (as SIGKILL
        # would: whatever was saved stays saved, every file is written atomically).
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["train"]:  # the command line, not a call from Python
        from sleuth.system.allocator import use_allocator

        try:
            use_allocator(sys.argv[1:])  # returns only when it leaves the allocator as it is
        except UserError as e:
            print(f"sleuth: error: {e}", file=sys.stderr)
            return 2
    global _terminated
    _terminated = False
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(True if getattr(args, "verbose", False) else None)
    previous = None
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"sleuth: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        # The environment, not sleuth: a read-only folder, a full disk, a folder where a file
        # belongs. One line naming the path and the cause; whatever was saved stays saved.
        print(f"sleuth: error: {describe_os_error(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sleuth: interrupted", file=sys.stderr)
        return 130
    except Exception:
        # The KeyboardInterrupt can land inside a library's import, which may swallow it half-way
        # and fail later (numpy did: "module 'numpy' has no attribute 'ndarray'"): still an interrupt.
        if _terminated:
            print("sleuth: interrupted", file=sys.stderr)
            return 130
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
