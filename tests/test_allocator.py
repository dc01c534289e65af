"""allocator.py: `sleuth train` keeps glibc malloc unless SLEUTH_ALLOCATOR=jemalloc, which re-executes
it with jemalloc preloaded (Ray's bundled one); a bad value is one line and exit 2."""

import os
import subprocess
import sys

import pytest

from sleuth.allocator import allocator_in_use, jemalloc_library


def dry_run(tiny, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "SLEUTH_ALLOCATOR")}
    return subprocess.run([sys.executable, "-m", "sleuth", "train", "--dry-run", f"model.path={tiny}"],
                          capture_output=True, text=True, timeout=300, env={**clean, **env})


@pytest.mark.skipif(jemalloc_library() is None, reason="no jemalloc on this machine (Ray not installed)")
def test_train_runs_on_jemalloc_when_asked(tiny_model_dir):
    proc = dry_run(tiny_model_dir)
    assert proc.returncode == 0, proc.stderr
    assert "memory allocator: glibc malloc" in proc.stdout.splitlines()
    proc = dry_run(tiny_model_dir, SLEUTH_ALLOCATOR="jemalloc")
    assert proc.returncode == 0, proc.stderr
    assert f"memory allocator: jemalloc ({jemalloc_library()})" in proc.stdout.splitlines()


def test_unknown_allocator_is_one_line_and_exit_2(tiny_model_dir):
    proc = dry_run(tiny_model_dir, SLEUTH_ALLOCATOR="tcmalloc")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "sleuth: error: SLEUTH_ALLOCATOR='tcmalloc': expected system or jemalloc"]


def test_this_process_reports_its_allocator():
    expected = "jemalloc" if "jemalloc" in os.environ.get("LD_PRELOAD", "") else "glibc malloc"
    assert allocator_in_use().startswith(expected)
