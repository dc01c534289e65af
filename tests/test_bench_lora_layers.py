"""bench/lora_layers.py's command line: a bad --layers exits 2 with a one-line error before any model loads."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "lora_layers.py"


@pytest.mark.parametrize("layers, message", [
    ("all,x", "--layers 'all,x': expected 'all' or integers, comma-separated"),
    ("all,0", "--layers 'all,0': layer counts must be at least 1"),
])
def test_bad_layers_exit_2(layers, message):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--layers", layers], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr.splitlines()[-1]
    assert "step_s" not in proc.stdout  # no table: nothing was timed
