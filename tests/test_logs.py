"""What a user sees on stderr: the libraries' INFO logs and known-benign warnings are left out by
default, everything comes back with --verbose / SLEUTH_LOG=debug, other warnings always show."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sleuth.system.logs import configure_logging


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_known_benign_warnings_are_dropped_and_others_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("SLEUTH_LOG", "VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(key, raising=False)
    assert configure_logging() is False
    assert os.environ["SLEUTH_LOG"] == "quiet" and os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    load_log = logging.getLogger("vllm.model_executor.models.utils")
    env_log = logging.getLogger("vllm.platforms.interface")
    seen = _Collect()
    for logger in (reload_log, load_log, env_log):
        logger.addHandler(seen)
    try:
        reload_log.warning("%s: Failed to load weights", "RotaryEmbedding")
        reload_log.warning("%s: Failed to load weights", "QKVParallelLinear")  # a real failure
        load_log.warning("Attempted to load weight %s with dtype %s into parameter with dtype %s",
                         "norm.weight", "torch.float32", "torch.bfloat16")
        load_log.warning("Attempted to load weight %s with dtype %s into parameter with dtype %s",
                         "norm.weight", "torch.bfloat16", "torch.float16")
        reload_log.warning("something else entirely")
        env_log.warning("Unknown vLLM environment variable detected: %s", "VLLM_DIST_IDENT")  # vLLM's own
        env_log.warning("Unknown vLLM environment variable detected: %s", "VLLM_TYPO")
    finally:
        for logger in (reload_log, load_log, env_log):
            logger.removeHandler(seen)
    assert seen.messages == ["QKVParallelLinear: Failed to load weights",
                             "Attempted to load weight norm.weight with dtype torch.bfloat16 into parameter "
                             "with dtype torch.float16", "something else entirely",
                             "Unknown vLLM environment variable detected: VLLM_TYPO"]
    configure_logging()  # twice: one filter per message, not two
    assert sum(f.__class__.__name__ == "_DropBenign" for f in reload_log.filters) == 1


def test_verbose_turns_every_log_back_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLEUTH_LOG", "debug")
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert configure_logging() is True and os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"


def _main_job_shaped(tiny: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The embedded default (Temporal Clue, vLLM, guided sample, weight syncs) on the tiny model."""
    env = {k: v for k, v in os.environ.items() if k not in ("SLEUTH_LOG", "VLLM_LOGGING_LEVEL")}
    args = ["train", f"model.path={tiny}", "model.dtype=float32", "rollout.kv_cache_gb=0.25",
            "loop.iterations=3", "loop.tasks_per_iteration=2", "task.eval_size=2", "rollout.max_tokens=16",
            "sft.steps=2", "sft.batch_tokens=16",
            "loop.time_budget_min=null", "eval.k=1", "logging.tensorboard=false", "--out", str(out), *extra]
    return subprocess.run([sys.executable, "-m", "sleuth.cli", *args], capture_output=True, text=True,
                          timeout=900, env=env)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_main_job_shaped_run_prints_few_lines(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    quiet = _main_job_shaped(tiny_model_dir, tmp_path / "quiet")
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    lines = [line for line in quiet.stderr.splitlines() if line.strip()]
    assert not [line for line in lines if "Failed to load weights" in line or "reset prefix cache" in line]
    assert not [line for line in lines if " INFO " in line]
    assert not [line for line in lines if " WARNING " in line], "\n".join(lines)  # vLLM's start-up notes (logs.BENIGN)
    assert len(lines) <= 25, "\n".join(lines)
    loud = _main_job_shaped(tiny_model_dir, tmp_path / "loud", "--verbose")
    assert loud.returncode == 0, loud.stderr[-2000:]
    assert " INFO " in loud.stderr and len(loud.stderr.splitlines()) > len(lines)
