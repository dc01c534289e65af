"""`--smoke` for the bench/ scripts: the tiny model, the smallest sizes, seconds instead of minutes.

A script's smoke run takes the same code path as its full run (the same functions, the same metric
keys read, the same table and last `name=value` line) on `sleuth.testing.tiny_model` and sizes
small enough for a test: tests/test_bench_smoke.py runs every script in bench/ so, so a renamed key
or a moved function breaks a test instead of a headline figure weeks later. Figures from a smoke
run mean nothing. (The leading underscore keeps this helper out of that test's list of scripts.)
"""

from __future__ import annotations

import argparse
import atexit
import functools
import shutil
import tempfile
from pathlib import Path

SMOKE_HELP = "the tiny random model and the smallest sizes: checks the script runs (figures mean nothing)"


def add_smoke_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


@functools.cache
def tiny_model_folder() -> str:
    """sleuth.testing.tiny_model (default sizes) written once per process into a temporary folder
    that is removed when the process exits; child processes the script starts may read it meanwhile."""
    from sleuth.testing.tiny_model import write_tiny_model

    root = tempfile.mkdtemp(prefix="sleuth-bench-smoke-")
    atexit.register(shutil.rmtree, root, True)
    return str(write_tiny_model(Path(root) / "tiny"))


def default_run_overrides() -> list[str]:
    """Overrides that shrink the main job (`sleuth train` with no config) to a smoke run on the tiny
    model: the same recipe (Temporal Clue in deduce form, a warm start, held-out evaluation with the
    clues removed at the end), two SFT steps of one puzzle, one puzzle of two samples of 8 tokens per
    iteration, two held-out puzzles, the transformers engine, every group trained on."""
    return [f"model.path={tiny_model_folder()}", "model.lora.last_layers=null", "rollout.engine=hf",
            "sft.steps=2", "sft.batch_tokens=16",
            "rollout.samples_per_task=2", "rollout.max_tokens=8", "loop.tasks_per_iteration=1",
            "trainer.mini_batches=1", "task.eval_size=2", "eval.k=1",
            # a random model's two samples often earn the same reward: train on the group anyway
            "algorithm.drop_zero_advantage=false"]
