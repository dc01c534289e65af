"""bench/ladder.py --smoke: the rung table on 3 puzzles per rung, ending with name=value pairs."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "ladder.py"


def test_smoke_prints_a_row_per_rung_and_a_headline():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--rungs", "lookup,elim1,elim2,1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("# cpu: ") and lines[1].split()[0] == "rung"
    rows = {line.split()[0]: line.split() for line in lines[2:6]}
    assert list(rows) == ["lookup", "elim1", "elim2", "1"]
    # Every rung puzzle is answered by propagation at exactly its rung's depth; difficulty 1 is beyond the language.
    assert rows["lookup"][-1] == "0:3" and rows["elim1"][-1] == "1:3" and rows["elim2"][-1] == "2:3"
    assert rows["1"][-1].startswith("-:")
    assert "lookup_tokens=" in lines[-1] and "1_constant_minus_chance=" in lines[-1]


def test_bad_n_exits_2():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--n", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--n 0" in proc.stderr.splitlines()[-1]
