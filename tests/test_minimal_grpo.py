"""examples/minimal_grpo.py: the whole loop in one short file, run for real on the tiny model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "minimal_grpo.py"


def test_the_minimal_loop_is_short() -> None:
    assert len(EXAMPLE.read_text().splitlines()) <= 300


def test_the_minimal_loop_trains(tiny_model_dir: Path, lowercase_task: Path) -> None:
    args = [f"model.path={tiny_model_dir}", "model.dtype=float32", f"task.name={lowercase_task}:problems",
            "task.verifier_isolation=inline", "loop.iterations=2", "loop.eval_every=1", "rollout.samples_per_task=4",
            "rollout.max_tokens=8", "task.eval_size=3", "trainer.lr=0.02", "model.lora.rank=4"]
    proc = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("held-out reward before training: ")
    iters = [line for line in lines if line.startswith("iter ")]
    assert [line.split()[1] for line in iters] == ["1/2", "2/2"]
    assert "val " in iters[0] and "val " not in iters[1]  # evaluated on the schedule, not after the last
    # the lowercase task gives every group differing rewards: groups are kept and the step has a gradient
    assert all(" groups 0/" not in line for line in iters)
    assert all(float(line.split(" grad ")[1].split()[0]) > 0 for line in iters)
    assert lines[-1].startswith("held-out reward after training:  ")
