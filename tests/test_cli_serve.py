"""`sleuth serve` as a real process, queried with the real openai client."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from sleuth.cli import main
from sleuth.testing.tiny_model import write_tiny_model

SRC = Path(__file__).resolve().parents[1] / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_flags_exit_2(capsys):
    assert main(["serve", "--model", "x", "--port", "0"]) == 2
    assert "--port must be in 1..65535" in capsys.readouterr().err


def serve(model: Path, port: int, *extra: str) -> subprocess.Popen:
    """`sleuth serve` on the transformers engine in its own process, once it answers /v1/models."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "sleuth", "serve", "--model", str(model), "--port", str(port),
                             "--engine", "hf", *extra], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("server did not come up")
        time.sleep(0.5)


@pytest.mark.slow
def test_serve_answers_openai_clients(tmp_path):
    model = write_tiny_model(tmp_path / "tiny")
    port = free_port()
    proc = serve(model, port, "--max-tokens", "5")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="anything", messages=[{"role": "user", "content": "hi"}], n=2)
        assert [c.finish_reason in ("stop", "length") for c in r.choices] == [True, True]
        assert 2 <= r.usage.completion_tokens <= 10  # --max-tokens 5 per choice
        with pytest.raises(openai.NotFoundError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/e/none/v1", api_key="none", max_retries=0) \
                .chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert "serving" in proc.stderr.read()


def _run_dir_naming_code(tmp_path, model: Path) -> tuple[Path, Path]:
    """A run directory whose config names a task module and an advantage function that write a
    marker file when imported."""
    marker = tmp_path / "imported"
    evil = tmp_path / "evil_task.py"
    evil.write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                    "def problems(cfg):\n    return []\n"
                    "def advantage(rewards):\n    return rewards\n")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(model, run / "model")
    (run / "config.yaml").write_text(f"task:\n  name: {evil}:problems\nalgorithm:\n  advantage: {evil}:advantage\n"
                                     "rollout:\n  max_tokens: 7\n")
    return run, marker


def test_serving_a_run_directory_imports_none_of_its_code(tmp_path, tiny_model_dir, capsys):
    from sleuth.cli.serve import serve_config

    run, marker = _run_dir_naming_code(tmp_path, tiny_model_dir)
    cfg = serve_config(str(run), ["rollout.temperature=0.5"])
    assert (cfg.rollout.max_tokens, cfg.rollout.temperature) == (7, 0.5)  # the run's own engine settings
    assert not marker.exists()
    assert "evil_task" not in capsys.readouterr().err  # nothing to announce: no code is imported
    # a moved task module is no error either, and settings that name code are refused, not imported
    (tmp_path / "evil_task.py").unlink()
    serve_config(str(run), [])
    for override in (f"task.name={tmp_path}/evil_task.py:problems", "algorithm.loss=x:y", "task.eval_size=3"):
        assert main(["serve", "--model", str(run), "--port", str(free_port()), override]) == 2
        assert "only model, rollout, loop settings apply here" in capsys.readouterr().err
    assert not marker.exists()


def test_a_port_in_use_is_one_line_and_exit_2_before_the_model_loads(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        # the model does not exist: had it been loaded first, that would be the error
        assert main(["serve", "--model", "/nonexistent/model", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"sleuth: error: --port {port}: 127.0.0.1:{port} is in use (another server?); "
                   "choose another --port"]


@pytest.mark.slow
def test_serve_a_run_directory_without_its_task_module(tmp_path, tiny_model_dir):
    run, marker = _run_dir_naming_code(tmp_path, tiny_model_dir)
    (tmp_path / "evil_task.py").unlink()  # the task module moved away: serving still works
    port = free_port()
    proc = serve(run, port, "--max-tokens", "3")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert not marker.exists()
