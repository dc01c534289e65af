"""bench/gateway_hostile.py --smoke: hostile bodies are refused with the right statuses, the server keeps answering."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gateway_hostile.py"


def test_smoke_prints_a_table_and_a_name_value_line():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip().splitlines()
    table = "\n".join(out)
    assert re.search(r"body over the cap .* 413 request_too_large", table)
    assert re.search(r"text past the context .* 400 context_length_exceeded", table)
    assert re.search(r"text inside the bound .* 400 context_length_exceeded", table)
    assert re.search(r"nested body .* 400 invalid_request_error", table)
    assert all(int(line.split()[-3]) > 0 for line in out[2:-1])  # small requests were served meanwhile
    pairs = dict(p.split("=") for p in out[-1].split())
    assert set(pairs) >= {"body_over_the_cap_s", "nested_body_s", "worst_small_request_s", "peak_rss_mb"}
