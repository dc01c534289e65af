"""The C memory allocator of `sleuth train`: mimalloc by default; SLEUTH_ALLOCATOR=system (glibc),
jemalloc or mimalloc to choose.

    use_allocator(argv)    # first thing in the CLI: re-executes this process with the allocator preloaded
    release_pages(tensors) # memory a stage keeps but will not read again goes back to the system
    return_free_memory()   # after a phase whose objects are gone: the allocator's free pages go back now

Why it matters: torch on CPU takes every tensor from malloc. A training step allocates and frees
activations of many sizes (tens of MB each); glibc serves them from heaps it cannot shrink past a
live chunk, so a default step peaks at twice its live tensors (8.1 GB for ~4 GB) and the process
keeps ~7 GB it no longer uses. A size-class allocator halves that peak; what differs is when it
hands freed pages back to the system (docs/benchmarks.md, "memory", has the figures):
- jemalloc returns them on a decay curve starting at once, so the next step re-faults them: ~20%
  more training time; keeping them instead let a whole run grow to 12-24 GB.
- mimalloc returns a page only after it has been unused for MIMALLOC_PURGE_DELAY ms (set here to
  PURGE_DELAY_MS unless the environment sets it). A step reuses its pages across its rows, seconds
  apart: with mimalloc's own 10 ms, or 1 s, it re-faults them (22.0 / 18.8 s a step against glibc's
  14.0 s); with 10 s it keeps them while it runs, and what a stage leaves behind goes back during
  the next one. Never returning them (-1) was fastest for one step (12.3 s) but is the setting that
  let jemalloc grow without bound over a run.

Which library: jemalloc from Ray's wheel (ray/core/libjemalloc.so, a dependency of sleuth) or a
system libjemalloc2; mimalloc from the `cmeel-mimalloc` wheel (a dependency too). The switch needs
LD_PRELOAD, so it is a re-exec of the same command before anything has run: the process id,
arguments and standard streams stay the same.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.metadata
import importlib.util
import mmap
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from sleuth.errors import UserError

ENV = "SLEUTH_ALLOCATOR"
"""system (glibc malloc), jemalloc or mimalloc; unset: DEFAULT."""

DEFAULT = "mimalloc"
"""The allocator when SLEUTH_ALLOCATOR is unset (glibc where its library is missing, e.g. not Linux):
the default run's peak falls from 11.2 to 7.7 GB at the same time per iteration (docs/benchmarks.md,
"memory")."""

PURGE_DELAY_MS = 10_000
"""mimalloc: a freed page goes back to the system after this long unused (its own default is 10 ms,
which re-faults a training step's activations every step)."""

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


def mimalloc_library() -> Path | None:
    """libmimalloc.so of the installed cmeel-mimalloc wheel; None without it."""
    try:
        located = importlib.metadata.distribution("cmeel-mimalloc").locate_file("cmeel.prefix/lib/libmimalloc.so")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(located))
    return path if path.is_file() else None


LIBRARIES: dict[str, Callable[[], Path | None]] = {"jemalloc": jemalloc_library, "mimalloc": mimalloc_library}
SETTINGS: dict[str, dict[str, str]] = {"mimalloc": {"MIMALLOC_PURGE_DELAY": str(PURGE_DELAY_MS)}}
"""Environment each allocator starts with (a value already in the environment wins)."""


def use_allocator(argv: Sequence[str]) -> None:
    """Re-execute `python -m sleuth ARGV` with the chosen allocator preloaded (unless it already is,
    or the choice is the system's); UserError when it is asked for and cannot be had."""
    asked = os.environ.get(ENV)
    choice = DEFAULT if asked is None else asked
    if choice != "system" and choice not in LIBRARIES:
        raise UserError(f"{ENV}={choice!r}: expected system, {', '.join(LIBRARIES)}")
    if choice == "system" or choice in os.environ.get("LD_PRELOAD", ""):
        return
    library = LIBRARIES[choice]() if sys.platform.startswith("linux") else None
    if library is None and asked is None:  # the default where its library is not to be had
        return
    if library is None:
        raise UserError(f"{ENV}={choice}: no {choice} library found (see sleuth/system/allocator.py); "
                        f"set {ENV}=system to use the system allocator")
    preload = " ".join(p for p in (str(library), os.environ.get("LD_PRELOAD", "")) if p)
    env = {**SETTINGS.get(choice, {}), **os.environ, "LD_PRELOAD": preload}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "sleuth", *argv], env)


def allocator_in_use() -> str:
    """'jemalloc (PATH)' or 'mimalloc (PATH), purge delay N ms' when one is mapped into this process,
    else 'glibc malloc'."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "the platform's malloc"
    for line in maps.splitlines():
        for name in LIBRARIES:
            if name in line.rsplit("/", 1)[-1]:
                if name == "mimalloc":  # its own default is 10 ms
                    return f"mimalloc ({line.split()[-1]}), purge delay {os.environ.get('MIMALLOC_PURGE_DELAY', '10')} ms"
                return f"{name} ({line.split()[-1]})"
    return "glibc malloc"


MADV_DONTNEED = 4
"""Linux madvise: drop the pages now; the next touch maps fresh zero pages."""


def release_pages(tensors: Iterable[Any]) -> int:
    """Give the memory of these CPU tensors back to the system while they stay allocated: every whole
    page inside each one's storage is dropped (MADV_DONTNEED) and reads as zeros from then on, faulted
    in again page by page when touched. For a buffer a stage keeps but will rewrite before it reads
    (vLLM's KV cache between two rollouts). Returns the bytes released; 0 off Linux."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page, released, seen = mmap.PAGESIZE, 0, set()
    for t in tensors:
        storage = t.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        if t.device.type != "cpu" or start in seen or size == 0:
            continue
        seen.add(start)
        first = -(-start // page) * page  # whole pages only: the neighbours' bytes stay as they are
        length = (start + size - first) // page * page
        if length <= 0:
            continue
        if libc.madvise(first, length, MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), f"madvise(MADV_DONTNEED) of {length} bytes failed")
        released += length
    return released


def resident_gib() -> float:
    """This process's resident memory now, GiB (Linux /proc; 0.0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20  # kB
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def return_free_memory() -> float:
    """Collect unreachable objects (a finished phase's model and optimizer sit in reference cycles
    until the cycle collector runs), then hand the allocator's free pages back to the system now:
    mimalloc's mi_collect(force) when it is preloaded, glibc's malloc_trim otherwise (jemalloc:
    nothing). Neither lets go of such pages on its own while nothing is allocated: after a 3-step
    warm start a mimalloc process stayed at 1.34 GiB for 12 s (purge delay 10 s), 0.79 once called.
    After `sleuth train`'s warm start it returns 2.3-2.9 GiB, so the process stands lower while RL's
    engine starts and the first evaluation runs; the run's peak, set later by the evaluations and
    RL's steps, moves 0.03 GiB (docs/log.md, 2026-12-08). Returns the GiB the resident set shrank by."""
    before = resident_gib()
    gc.collect()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None)
        if hasattr(libc, "mi_collect"):
            libc.mi_collect.argtypes = [ctypes.c_bool]
            libc.mi_collect(True)
        elif "jemalloc" not in allocator_in_use():
            libc.malloc_trim(0)
    return max(0.0, before - resident_gib())
