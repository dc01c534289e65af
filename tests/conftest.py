"""Fixtures shared by the test files: the tiny model folder and the tiny user task the end-to-end
tests train on (built once per test session)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from sleuth.testing.tasks import lowercase_task_source
from sleuth.testing.tiny_model import write_tiny_model

# Runs with loop.deterministic ask MKL for reproducible results (system.hardware.reproducible_cpu_math), which
# MKL reads at its first call: the in-process runs the tests compare subprocess runs against must
# have it from the start too, or they would compute with MKL's other code paths.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

RAY_FILES = frozenset({"test_cluster_runtime.py", "test_collective.py", "test_loop_cluster.py",
                       "test_rollout_pool.py", "test_stream.py", "test_trainer_group.py", "test_bench_smoke.py"})
"""Test files that start local Ray clusters (test_bench_smoke.py: bench/scale.py; its module fixture
also starts every selected smoke run, so the file must stay on one worker): under pytest-xdist
(pyproject's `-n 2 --dist loadgroup`) they run one after another on one worker, so two clusters never
start at once on a 2-core machine; the other files spread over both workers."""


def pytest_configure(config: pytest.Config) -> None:
    """In each xdist worker: one compute thread (torch here, OMP_NUM_THREADS for the runs it starts),
    so two workers share two cores without oversubscribing them (OpenMP threads that wait on a
    core another process holds). Before the workers start (in the controlling process only):
    convert SmolLM2's GGUF into its cached HF folder once, so two workers never write it at once."""
    if hasattr(config, "workerinput"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        return
    from sleuth.system.models import SMOLLM2_ALIAS, resolve_model_path
    resolve_model_path(SMOLLM2_ALIAS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in RAY_FILES:
            item.add_marker(pytest.mark.xdist_group("ray"))


LOWERCASE_TASK = lowercase_task_source(64, 3)
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


@pytest.fixture
def count_saved(monkeypatch: pytest.MonkeyPatch) -> Callable[[], contextlib.AbstractContextManager[dict[int, int]]]:
    """`with count_saved() as kept:` records the bytes autograd keeps for backward inside the block
    (storage -> bytes, each storage once), including what sleuth.train.kernels.recompute's own pack hooks
    keep as it is (an outer hook does not see what an inner one packs)."""
    from sleuth.train.kernels import recompute

    kept: dict[int, int] = {}

    def count(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def counting_hooks(pack: Callable, unpack: Callable) -> torch.autograd.graph.saved_tensors_hooks:
        def counted(t: torch.Tensor) -> object:
            packed = pack(t)
            return count(packed) if isinstance(packed, torch.Tensor) else packed
        return torch.autograd.graph.saved_tensors_hooks(counted, unpack)

    monkeypatch.setattr(recompute, "saved_tensors_hooks", counting_hooks)

    @contextlib.contextmanager
    def block() -> Iterator[dict[int, int]]:
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            yield kept

    return block


@pytest.fixture
def lm_backward(count_saved: Callable) -> Callable:
    """`lm_backward(model, ids) -> (loss, gradients by name, bytes kept for backward)`: a language-
    modelling loss of a causal LM on ids [1, T], counted with count_saved."""

    def run(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        with count_saved() as kept:
            logits = model(input_ids=ids).logits.float()
            loss = torch.log_softmax(logits, -1)[0, :-1].gather(-1, ids[0, 1:, None]).mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return loss.detach(), grads, sum(kept.values())

    return run
