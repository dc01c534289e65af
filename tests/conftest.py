"""Fixtures shared by the test files: the tiny model folder and the tiny user task the end-to-end
tests train on (built once per test session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sleuth.testing.tiny_model import write_tiny_model

LOWERCASE_TASK = '''
def problems(cfg):
    for i in range(64):
        yield {"id": f"p{i}", "prompt": f"Write lowercase letters ({i})", "answer": None,
               "split": "eval" if i < 3 else "train"}


def verify(answer, text):
    return sum("a" <= c <= "z" for c in text) / len(text) if text else 0.0
'''
"""A user task whose verifier rewards the fraction of lowercase letters in a completion: a
random-init byte-level model earns varied rewards on it from the first iteration, so every
iteration really trains (a reward that is always 0 would leave the weights unchanged)."""


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sleuth.testing.tiny_model with its default sizes, as a model folder."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def lowercase_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LOWERCASE_TASK as a file: name it as task.name=f"{lowercase_task}:problems"."""
    path = tmp_path_factory.mktemp("task") / "lowercase_task.py"
    path.write_text(LOWERCASE_TASK)
    return path
