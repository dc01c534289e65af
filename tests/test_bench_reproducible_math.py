"""bench/reproducible_math.py: bad flags are one-line errors with exit code 2 (the timings themselves
take minutes on SmolLM2 and are recorded in docs/benchmarks.md)."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "reproducible_math.py"


@pytest.mark.parametrize(("flags", "names"), [(["--dtypes", "int8"], "--dtypes"), (["--dtypes", ","], "--dtypes"),
                                              (["--reps", "0"], "--reps")])
def test_bad_flags_exit_2_naming_the_flag(flags, names):
    done = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert names in done.stderr.strip().splitlines()[-1]
    assert done.stdout == ""
