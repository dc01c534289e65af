"""allocator.py: SLEUTH_ALLOCATOR=system|jemalloc|mimalloc re-executes `sleuth train` with that
allocator preloaded (Ray's bundled jemalloc, the cmeel-mimalloc wheel's mimalloc); a bad value is
one line and exit 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sleuth.system.allocator import (
    DEFAULT,
    PURGE_DELAY_MS,
    allocator_in_use,
    jemalloc_library,
    mimalloc_library,
)


def _dry_run(tiny, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "SLEUTH_ALLOCATOR", "MIMALLOC_PURGE_DELAY")}
    return subprocess.run([sys.executable, "-m", "sleuth", "train", "--dry-run", f"model.path={tiny}"],
                          capture_output=True, text=True, timeout=300, env={**clean, **env})


SETTINGS = [{}, {"SLEUTH_ALLOCATOR": "system"}, {"SLEUTH_ALLOCATOR": "jemalloc"}, {"SLEUTH_ALLOCATOR": "mimalloc"},
            {"SLEUTH_ALLOCATOR": "mimalloc", "MIMALLOC_PURGE_DELAY": "7"}, {"SLEUTH_ALLOCATOR": "tcmalloc"}]
"""Every environment the tests below run `sleuth train --dry-run` under."""


@pytest.fixture(scope="module")
def dry_runs(tiny_model_dir):
    """The dry runs of SETTINGS, two at a time (each is one process start, mostly one core's work)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(_dry_run, tiny_model_dir, env) for env in SETTINGS]
        yield {tuple(sorted(env.items())): f for env, f in zip(SETTINGS, futures, strict=True)}


@pytest.fixture
def dry_run(dry_runs):
    def get(_tiny, **env: str) -> subprocess.CompletedProcess:
        return dry_runs[tuple(sorted(env.items()))].result()

    return get


@pytest.mark.skipif(jemalloc_library() is None, reason="no jemalloc on this machine (Ray not installed)")
def test_train_runs_on_jemalloc_when_asked(tiny_model_dir, dry_run):
    proc = dry_run(tiny_model_dir, SLEUTH_ALLOCATOR="system")
    assert proc.returncode == 0, proc.stderr
    assert "memory allocator: glibc malloc" in proc.stdout.splitlines()
    proc = dry_run(tiny_model_dir, SLEUTH_ALLOCATOR="jemalloc")
    assert proc.returncode == 0, proc.stderr
    assert f"memory allocator: jemalloc ({jemalloc_library()})" in proc.stdout.splitlines()


@pytest.mark.skipif(mimalloc_library() is None, reason="cmeel-mimalloc is not installed")
def test_train_runs_on_mimalloc_with_its_purge_delay(tiny_model_dir, dry_run):
    lib = mimalloc_library()
    proc = dry_run(tiny_model_dir, SLEUTH_ALLOCATOR="mimalloc")
    assert proc.returncode == 0, proc.stderr
    assert f"memory allocator: mimalloc ({lib}), purge delay {PURGE_DELAY_MS} ms" in proc.stdout.splitlines()
    proc = dry_run(tiny_model_dir, SLEUTH_ALLOCATOR="mimalloc", MIMALLOC_PURGE_DELAY="7")  # the user's wins
    assert f"memory allocator: mimalloc ({lib}), purge delay 7 ms" in proc.stdout.splitlines()


def test_the_default_allocator_is_the_documented_one(tiny_model_dir, dry_run):
    proc = dry_run(tiny_model_dir)
    assert proc.returncode == 0, proc.stderr
    want = "glibc malloc" if DEFAULT == "system" else DEFAULT
    assert any(line.startswith(f"memory allocator: {want}") for line in proc.stdout.splitlines())
    assert PURGE_DELAY_MS >= 100  # mimalloc's own 10 ms re-faults every training step


def test_unknown_allocator_is_one_line_and_exit_2(tiny_model_dir, dry_run):
    proc = dry_run(tiny_model_dir, SLEUTH_ALLOCATOR="tcmalloc")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "sleuth: error: SLEUTH_ALLOCATOR='tcmalloc': expected system, jemalloc, mimalloc"]


def test_this_process_reports_its_allocator():
    preload = os.environ.get("LD_PRELOAD", "")
    expected = next((name for name in ("jemalloc", "mimalloc") if name in preload), "glibc malloc")
    assert allocator_in_use().startswith(expected)


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")
def test_release_pages_gives_a_tensors_memory_back_and_it_reads_zeros():
    import mmap

    import torch

    from sleuth.system.allocator import release_pages

    buffer = torch.ones(64 * 2**20, dtype=torch.int8)  # 64 MiB, every page touched
    view = buffer[: 2**20]  # a view of the same storage: released once
    before = _rss_anon()
    released = release_pages([buffer, view])
    after = _rss_anon()
    page = mmap.PAGESIZE
    start = buffer.data_ptr()
    first = -(-start // page) * page
    assert released == (start + buffer.numel() - first) // page * page  # the whole pages inside it
    assert released >= 64 * 2**20 - page
    assert before - after >= 0.9 * released  # the pages really left the resident set
    inside = buffer[first - start : first - start + released]
    assert int(inside.count_nonzero()) == 0  # released pages read as zeros
    assert bool((buffer[: first - start] == 1).all())  # bytes outside whole pages are untouched
    inside.fill_(3)  # and the tensor stays usable: pages come back on the next write
    assert int(buffer.sum()) == 3 * released + (buffer.numel() - released)


FRAGMENTED = """
import ctypes, json
from sleuth.system.allocator import allocator_in_use, resident_gib, return_free_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
big, small = [], []
for _ in range(2000):  # 200 MB of 100 kB blocks, each followed by a live 64-byte one
    block = libc.malloc(100_000)
    ctypes.memset(block, 1, 100_000)
    big.append(block)
    small.append(libc.malloc(64))
for block in big:
    libc.free(block)
held = resident_gib()
freed = return_free_memory()
print(json.dumps({"allocator": allocator_in_use(), "held": held, "freed": freed, "after": resident_gib()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and the allocators' calls are Linux's")
@pytest.mark.parametrize("allocator", ["glibc", "mimalloc"])
def test_return_free_memory_hands_freed_blocks_back(allocator):
    """Freed blocks between live ones stay resident under both allocators (glibc cannot trim past a
    live chunk, mimalloc waits out its purge delay) until return_free_memory hands them back."""
    import json

    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MIMALLOC_PURGE_DELAY")}
    if allocator == "mimalloc":
        if mimalloc_library() is None:
            pytest.skip("cmeel-mimalloc is not installed")
        clean.update(LD_PRELOAD=str(mimalloc_library()), MIMALLOC_PURGE_DELAY=str(PURGE_DELAY_MS))
    done = subprocess.run([sys.executable, "-c", FRAGMENTED], capture_output=True, text=True, timeout=120, env=clean)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["allocator"].startswith(allocator)
    assert got["held"] > 0.15  # the 200 MB were still resident after free()
    assert got["freed"] > 0.15 and got["after"] < got["held"] - 0.15
