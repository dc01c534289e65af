"""The C memory allocator of `sleuth train`: glibc's, or jemalloc with SLEUTH_ALLOCATOR=jemalloc.

    use_jemalloc(argv)     # first thing in the CLI: re-executes this process with jemalloc preloaded

Why it matters: torch on CPU takes every tensor from malloc. A training step allocates and frees
activations of many sizes (tens of MB each); glibc serves them from heaps it cannot shrink past a
live chunk, so a default step peaks at twice its live tensors (8.1 GB for ~4 GB) and the process
keeps ~7 GB it no longer uses. jemalloc's size classes halve that step peak and hand the pages
back, at ~20% more training time (it re-faults them on the next step), so it is an opt-in for
machines short of memory, not the default (docs/benchmarks.md, "memory", has the figures; keeping
the pages instead made steps faster but let a whole run grow to 12-24 GB).

Which jemalloc: Ray's wheel (a dependency of sleuth) ships one as ray/core/libjemalloc.so; a
system one (Debian's libjemalloc2) is used when Ray is not installed. The switch needs LD_PRELOAD,
so it is a re-exec of the same command before anything has run: the process id, arguments and
standard streams stay the same.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from sleuth.errors import UserError

ENV = "SLEUTH_ALLOCATOR"
"""system (the default: glibc malloc) or jemalloc."""

SYSTEM_JEMALLOC = ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
                   "/usr/lib64/libjemalloc.so.2")


def jemalloc_library() -> Path | None:
    """Ray's bundled jemalloc, else a system one; None when there is neither."""
    spec = importlib.util.find_spec("ray")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            bundled = Path(root) / "core" / "libjemalloc.so"
            if bundled.is_file():
                return bundled
    return next((Path(p) for p in SYSTEM_JEMALLOC if Path(p).is_file()), None)


def use_jemalloc(argv: Sequence[str]) -> None:
    """With SLEUTH_ALLOCATOR=jemalloc, re-execute `python -m sleuth ARGV` with jemalloc preloaded
    (unless it already is); UserError when it is asked for and cannot be had."""
    choice = os.environ.get(ENV, "system")
    if choice not in ("jemalloc", "system"):
        raise UserError(f"{ENV}={choice!r}: expected system or jemalloc")
    if choice == "system" or "jemalloc" in os.environ.get("LD_PRELOAD", ""):
        return
    library = jemalloc_library()
    if library is None or not sys.platform.startswith("linux"):
        raise UserError(f"{ENV}=jemalloc: no jemalloc found (Ray's wheel or libjemalloc2 on Linux); "
                        f"unset {ENV} to use the system allocator")
    preload = " ".join(p for p in (str(library), os.environ.get("LD_PRELOAD", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "sleuth", *argv], dict(os.environ, LD_PRELOAD=preload))


def allocator_in_use() -> str:
    """'jemalloc (PATH)' when a jemalloc is mapped into this process, else 'glibc malloc'."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "the platform's malloc"
    for line in maps.splitlines():
        if "jemalloc" in line:
            return f"jemalloc ({line.split()[-1]})"
    return "glibc malloc"
