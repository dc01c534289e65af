import json
import subprocess
import sys
from pathlib import Path

import pytest

from sleuth.cli import main
from sleuth.cli.train import default_config_path, split_args
from sleuth.config import load_config
from sleuth.errors import UserError
from sleuth.testing.tiny_model import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_shipped_default_mirrors_embedded():
    assert load_config(ROOT / "configs" / "default.yaml") == load_config(default_config_path())
    cfg = load_config(default_config_path())
    assert cfg.model.path == "smollm2-135m-instruct"
    assert cfg.model.lora.enabled
    assert (cfg.task.name, cfg.task.difficulty, cfg.task.list_choices) == ("temporal_clue", 1, True)


def test_published_configs():
    tc = load_config(ROOT / "configs" / "temporal-clue-qwen2.5-14b.yaml")
    assert (tc.loop.tasks_per_iteration, tc.rollout.samples_per_task, tc.trainer.lr) == (32, 50, 6e-6)
    aime = load_config(ROOT / "configs" / "aime-lora.yaml")
    assert aime.model.lora.enabled and aime.task.name == "math" and aime.eval.k == 8
    assert aime.task.eval_path == "../shared/data/aime2024.jsonl"


def test_split_args():
    assert split_args(["c.yaml", "a.b=1", "c.d=x=y"]) == ("c.yaml", ["a.b=1", "c.d=x=y"])
    assert split_args(["a.b=1"]) == (None, ["a.b=1"])
    with pytest.raises(UserError, match="at most one config file"):
        split_args(["a.yaml", "b.yaml"])


@pytest.mark.parametrize("config", ["temporal-clue-qwen2.5-14b.yaml", "aime-lora.yaml"])
def test_dry_run_shipped_configs(config, tiny, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs name data paths relative to the repository root
    code = main(["train", f"configs/{config}", f"model.path={tiny}", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"model: {tiny}" in out
    assert out.strip().splitlines()[-1] == "dry run ok: config, data and model folder are valid"


def test_dry_run_embedded_default(capsys):
    assert main(["train", "--dry-run", "task.eval_size=2"]) == 0
    out = capsys.readouterr().out
    assert "model: smollm2-135m-instruct" in out
    assert "task: temporal_clue (2 held-out problems" in out


def test_dry_run_rejects_bad_inputs(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    cases = [
        (["train", "--dry-run", "trainer.lrr=1"], "unknown config key 'trainer.lrr'"),
        (["train", str(tmp_path / "missing.yaml"), "--dry-run"], "cannot read config file"),
        (["train", "--dry-run", f"model.path={tmp_path / 'nowhere'}"], "is neither a folder nor a known alias"),
        (["train", "configs/aime-lora.yaml", f"model.path={tiny}", "task.eval_path=/no/such.jsonl",
          "--dry-run"], "cannot read math problem file /no/such.jsonl"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("sleuth: error: ") and message in err[0], err


def test_refuses_to_overwrite_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "iter-000001").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"iteration": 1}\n')
    assert main(["train", "--out", str(run), "loop.iterations=1"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == '{"iteration": 1}\n'
    assert main(["train", "c.yaml", "--resume", str(run)]) == 2
    assert "--resume takes the config from the run directory" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "none")]) == 2
    assert "not a sleuth run directory" in capsys.readouterr().err


def test_console_script_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sleuth", "train", "--dry-run", "loop.iterations=0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("sleuth: error: config key 'loop.iterations'")
    assert json.dumps  # stdout stays empty on errors
    assert proc.stdout == ""
