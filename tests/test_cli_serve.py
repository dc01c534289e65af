"""`sleuth serve` as a real process, queried with the real openai client."""

import os
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


@pytest.mark.slow
def test_serve_answers_openai_clients(tmp_path):
    model = write_tiny_model(tmp_path / "tiny")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "sleuth", "serve", "--model", str(model), "--port", str(port),
                             "--engine", "hf", "--max-tokens", "5"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
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
