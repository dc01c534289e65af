"""The loop on a Ray cluster (loop.py + cluster/): `sleuth train ... cluster.rollout_workers=2` against
the one-process run with the same seed, with a rollout worker killed by SIGKILL mid-run, and with the
driver killed by SIGKILL and resumed. The default (one process) never imports Ray."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from io import StringIO
from pathlib import Path

import pytest

from sleuth.config import load_config
from sleuth.loop.train import train
from test_loop import read_metrics

ITERATIONS = 4
RAY = ["cluster.rollout_workers=2", "cluster.cpus_per_worker=0.5", "cluster.object_store_gb=0.1"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir, lowercase_task):
    root = tmp_path_factory.mktemp("loop_cluster")
    tiny, task_file = tiny_model_dir, lowercase_task  # conftest.py: the loop tests' model and task
    args = [
        f"model.path={tiny}", "model.dtype=float32", "model.lora.rank=4", "model.lora.alpha=8",
        f"task.name={task_file}:problems", "task.verifier_isolation=inline", "loop.evaluate=false",
        "algorithm.credit=sequence", "algorithm.format_reward=0", "trainer.mini_batches=1",
        "rollout.engine=hf", "rollout.samples_per_task=4", "rollout.max_tokens=16", "trainer.lr=0.05",
        f"loop.iterations={ITERATIONS}", "loop.tasks_per_iteration=4", "loop.checkpoint_every=1",
        "loop.deterministic=true", "logging.tensorboard=false",
    ]
    reference = root / "reference"
    train(load_config(None, args), reference, out=StringIO())  # as `sleuth train` runs a user task
    return root, args, read_metrics(reference)


def assert_same_run(got: list[dict], want: list[dict]) -> float:
    """Per iteration: the same rewards and token counts; losses equal up to float rounding (the
    engines' logprobs enter the loss through TIS and differ in the last bits between processes).
    Returns the largest loss difference."""
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want]
    worst = 0.0
    for a, b in zip(got, want):
        assert (a["rollout/reward_mean"], a["rollout/tokens"]) == (b["rollout/reward_mean"], b["rollout/tokens"])
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-6), a["iteration"]
        worst = max(worst, abs(a["train/loss"] - b["train/loss"]))
    return worst


class Cli:
    """`sleuth train` in its own process group (so the Ray processes it starts can be cleaned up),
    its stdout and stderr read as they come."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "sleuth", "train", *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, ls=lines: ls.extend(iter(s.readline, "")), daemon=True).start()

    def wait_for(self, pattern: str, timeout: float = 400) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.out + self.err:
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None:
                time.sleep(0.5)  # let the readers finish
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}: {''.join(self.err)[-3000:]}")

    def finish(self, timeout: float = 400) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            # the driver's Ray agents outlive a SIGKILLed driver for a while
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)


def test_default_run_never_imports_ray(setup, monkeypatch, tmp_path):
    _, args, _ = setup
    monkeypatch.setitem(sys.modules, "ray", None)  # any `import ray` now raises ImportError
    result = train(load_config(None, [*args, "loop.iterations=1"]), tmp_path / "run",
                   out=StringIO())
    assert result.iterations_done == 1


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_two_rollout_workers_match_one_process_even_when_one_is_killed(setup, tmp_path, transport):
    """collective: the driver broadcasts the adapter over a gloo group; the killed worker gets the
    weights through the object store and the group is built again with its new process."""
    _, args, want = setup
    run = Cli([*args, *RAY, f"cluster.weight_transport={transport}", "--out", str(tmp_path / "run")], tmp_path)
    pid = int(run.wait_for(r"rollout worker 1: pid (\d+)").group(1))
    run.wait_for(r"^iter 1/")
    os.kill(pid, signal.SIGKILL)  # during iteration 2 (generation, or the step before its sync)
    assert run.finish() == 0, "".join(run.err)[-3000:]
    got = read_metrics(tmp_path / "run")
    assert_same_run(got, want)  # every group of every iteration, the same samples
    assert got[-1]["rollout/worker_restarts"] == 1
    assert got[0]["rollout/worker_restarts"] == 0
    # the killed worker was served through the object store at most once; every other sync (the one
    # right after the restart included, over the rebuilt group) went out as a broadcast
    assert got[-1]["sync/broadcast_fallbacks"] <= (1 if transport == "collective" else 0)


@pytest.mark.slow
def test_two_trainer_ranks_and_two_rollout_workers_match_one_process(setup, tmp_path):
    """FSDP2 ranks (gloo) and rollout workers as Ray actors, all started by `sleuth train`: the same
    rewards and tokens as one process, losses equal up to the sharded gradient sums' rounding.
    Trainer rank 0 broadcasts the weights to the workers (the driver never sees them); the object
    store's path with trainer ranks is the driver-killed test's below (auto on CPU)."""
    _, args, want = setup
    workers = ["cluster.trainer_workers=2", "cluster.rollout_workers=2", "cluster.cpus_per_worker=0.5",
               "cluster.object_store_gb=0.1", "cluster.weight_transport=collective"]
    run = Cli([*args, *workers, "--out", str(tmp_path / "run")], tmp_path)
    assert run.finish() == 0, "".join(run.err)[-3000:]
    assert any("trainer rank 1: pid" in line for line in run.err)
    got = read_metrics(tmp_path / "run")
    worst = assert_same_run(got, want)
    print(f"largest loss difference, 2 trainer ranks + 2 rollout workers vs one process: {worst:.2e}")
    assert got[-1]["sync/broadcast_fallbacks"] == 0
    # every sync checked: the ranks' probe (rank 0's logprobs) against each worker's
    assert all("time/sync_check_s" in r for r in got[1:]) and not any("not checked" in line for line in run.err)
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()  # exported by rank 0


@pytest.mark.slow
def test_driver_killed_then_resumed_with_other_trainer_worker_counts_continues_exactly(setup, tmp_path):
    """2 FSDP2 ranks and 2 Ray rollout workers; the ranks write sharded checkpoints; after a SIGKILL
    of the driver one process resumes them, is killed in turn, and 2 ranks resume its plain
    checkpoint: the same run as uninterrupted (the samples of every iteration included)."""
    _, args, want = setup
    ranks = ["cluster.trainer_workers=2", *RAY]
    run_dir = tmp_path / "run"
    first = Cli([*args, *ranks, "--out", str(run_dir)], tmp_path)
    wait_for_file(run_dir / "checkpoints" / "iter-000002" / "manifest.json")  # written last
    os.kill(first.proc.pid, signal.SIGKILL)
    assert first.finish() == -signal.SIGKILL
    assert (run_dir / "checkpoints" / "iter-000002" / "policy" / ".metadata").is_file()  # sharded
    alone = Cli(["--resume", str(run_dir), "cluster.trainer_workers=1"], tmp_path)
    wait_for_file(run_dir / "checkpoints" / "iter-000003" / "manifest.json")
    os.kill(alone.proc.pid, signal.SIGKILL)
    assert alone.finish() == -signal.SIGKILL
    assert not (run_dir / "checkpoints" / "iter-000003" / "policy" / ".metadata").exists()  # plain
    again = Cli(["--resume", str(run_dir), "cluster.trainer_workers=2"], tmp_path)
    assert again.finish() == 0, "".join(again.err)[-3000:]
    assert any("trainer rank 1: pid" in line for line in again.err)
    got = read_metrics(run_dir)
    assert_same_run(got, want)
    assert got[-1]["sync/broadcast_fallbacks"] == 0
    assert (run_dir / "model" / "model.safetensors").is_file()  # exported by rank 0


def wait_for_file(path: Path, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.vllm
def test_two_vllm_rollout_workers_match_one_vllm_process(setup, tmp_path):
    """vLLM seeds each request's sampler; its logits may depend on the batch a request lands in, so
    it promises equal samples only for equal batches. Measured here (CPU, this tiny model): equal."""
    pytest.importorskip("vllm")
    _, args, _ = setup
    vllm = ["rollout.engine=vllm", "rollout.kv_cache_gb=0.25"]
    train(load_config(None, [*args, *vllm]), tmp_path / "one", out=StringIO())
    want = read_metrics(tmp_path / "one")
    run = Cli([*args, *vllm, *RAY, "--out", str(tmp_path / "two")], tmp_path)
    assert run.finish() == 0, "".join(run.err)[-3000:]
    worst = assert_same_run(read_metrics(tmp_path / "two"), want)
    print(f"largest loss difference, 2 vLLM rollout workers vs one vLLM process: {worst:.2e}")


@pytest.mark.slow
def test_killed_trainer_rank_stops_the_run_with_one_line_naming_it_and_the_checkpoint(setup, tmp_path):
    _, args, _ = setup
    ranks = ["cluster.trainer_workers=2", "cluster.cpus_per_worker=0.5", "cluster.object_store_gb=0.1"]
    run = Cli([*args, *ranks, "--out", str(tmp_path / "run")], tmp_path)
    pid = int(run.wait_for(r"trainer rank 1: pid (\d+)").group(1))
    wait_for_file(tmp_path / "run" / "checkpoints" / "iter-000001" / "manifest.json")
    os.kill(pid, signal.SIGKILL)
    assert run.finish() == 2, "".join(run.err)[-3000:]
    errors = [line for line in run.err if line.startswith("sleuth: error")]
    assert len(errors) == 1, "".join(run.err)[-3000:]
    assert "trainer rank 1 died" in errors[0] and "iter-00000" in errors[0] and "--resume" in errors[0]
    assert "Traceback" not in "".join(run.err)


def test_killed_raylet_stops_the_run_with_one_line_and_a_resume_hint(setup, tmp_path):
    _, args, _ = setup
    run = Cli([*args, *RAY, "--out", str(tmp_path / "run")], tmp_path)
    wait_for_file(tmp_path / "run" / "checkpoints" / "iter-000001" / "manifest.json")
    session = os.getsid(run.proc.pid)
    raylets = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _comm(p) == "raylet"
               and _sid(p) == session]
    assert len(raylets) == 1
    os.kill(raylets[0], signal.SIGKILL)
    assert run.proc.wait(timeout=400) != 0
    time.sleep(2)  # the watcher's line follows the driver's exit
    run.finish()
    errors = [line for line in run.err if line.startswith("sleuth: error")]
    assert len(errors) == 1, "".join(run.err)[-3000:]
    assert f"raylet on this machine (pid {raylets[0]}) died" in errors[0]
    assert f"sleuth train --resume {tmp_path / 'run'}" in errors[0] and "Traceback" not in "".join(run.err)


def _comm(proc: Path) -> str:
    try:
        return (proc / "comm").read_text().strip()
    except OSError:
        return ""


def _sid(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rpartition(")")[2].split()[3])
    except (OSError, ValueError, IndexError):
        return -1
