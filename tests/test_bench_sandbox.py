"""bench/sandbox.py: the sandbox's per-call overhead, in its smoke mode."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "sandbox.py"


def test_smoke_prints_a_table_and_the_headline():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0].startswith("# cpu: ") and out[1].split()[:6] == ["script", "median", "ms", "max", "ms", "cpu"]
    assert [line.split()[0] for line in out[2:4]] == ["pass", "numpy"]
    assert "rlimits audit" in out[2]
    last = dict(kv.split("=") for kv in out[-1].split())
    assert set(last) == {"sandbox_call_ms", "sandbox_numpy_ms", "sandbox_call_cpu_ms"}
    assert 0 < float(last["sandbox_call_ms"]) < 10_000 and 0 < float(last["sandbox_call_cpu_ms"]) < 10_000
