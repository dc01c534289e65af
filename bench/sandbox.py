"""Benchmark: the per-call overhead of the Python sandbox (sleuth.tasks.sandbox.run_python).

    .venv/bin/python bench/sandbox.py [--calls 30] [--smoke]

Runs a trivial script (`pass`) and a small one that imports numpy, `--calls` times each, and
prints ms per call (median, max) with the layers that held, and the CPU ms the call's processes
used (median; less sensitive than wall time to other jobs on a busy machine); then one headline
line: sandbox_call_ms=<median of the trivial call> sandbox_numpy_ms=<median with numpy>
sandbox_call_cpu_ms=<CPU median of the trivial call>.
--smoke: 3 calls each (what tests/test_bench_sandbox.py runs).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from _smoke import add_smoke_flag
from sleuth.system.hardware import cpu_description
from sleuth.tasks.sandbox import SandboxLimits, run_python

SCRIPTS = {"pass": "pass", "numpy": "import numpy\nprint(numpy.arange(10).sum())"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30)
    add_smoke_flag(parser)  # 3 each
    args = parser.parse_args()
    calls = 3 if args.smoke else args.calls
    print(f"# cpu: {cpu_description()}", flush=True)
    limits = SandboxLimits(wall_s=30)
    rows = []
    for name, code in SCRIPTS.items():
        times, cpu, layers = [], [], ()
        for _ in range(calls):
            start, used = time.perf_counter(), _children_cpu()
            result = run_python(code, limits)
            times.append((time.perf_counter() - start) * 1000)
            cpu.append((_children_cpu() - used) * 1000)
            if result.reason != "ok":
                raise SystemExit(f"bench/sandbox.py: {name!r} ended with {result.reason}: {result.stderr[-300:]}")
            layers = result.layers
        rows.append((name, statistics.median(times), max(times), statistics.median(cpu), " ".join(layers)))
    print(f"{'script':<8} {'median ms':>10} {'max ms':>8} {'cpu ms':>7}  layers")
    for name, med, mx, cpu_ms, layers in rows:
        print(f"{name:<8} {med:>10.1f} {mx:>8.1f} {cpu_ms:>7.1f}  {layers}")
    print(f"sandbox_call_ms={rows[0][1]:.1f} sandbox_numpy_ms={rows[1][1]:.1f} sandbox_call_cpu_ms={rows[0][3]:.1f}")


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's reaped descendants."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
