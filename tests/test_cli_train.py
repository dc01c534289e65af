import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sleuth.cli import main
from sleuth.cli.train import config_source, default_config_path, recipes, split_args, user_code
from sleuth.config import load_config
from sleuth.errors import UserError
from sleuth.task_config import TemporalClueConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir


def test_the_main_job_is_the_temporal_clue_recipe():
    assert default_config_path() == recipes()["temporal_clue"]
    cfg = load_config(default_config_path())
    assert cfg.model.path == "smollm2-135m-instruct"
    assert not cfg.model.lora.enabled and cfg.sft.warm_start and cfg.eval.ablate_clues
    tc = cfg.task.temporal_clue
    assert (cfg.task.name, tc.difficulty, tc.reasoning, tc.list_choices) == ("temporal_clue", "elim1", "deduce", True)
    assert (cfg.task.eval_size, cfg.eval.k, cfg.loop.time_budget_min) == (200, 1, 15)
    assert load_config(recipes()["temporal_clue_direct"]).task.temporal_clue.difficulty == 1  # the main job before


def test_published_configs():
    tc = load_config(recipes()["temporal_clue_qwen2.5_14b"])
    assert (tc.loop.tasks_per_iteration, tc.rollout.samples_per_task, tc.trainer.lr) == (32, 50, 6e-6)
    aime = load_config(recipes()["aime_lora"])
    assert aime.model.lora.enabled and aime.task.name == "math" and aime.eval.k == 8
    assert aime.task.eval_path == "aime2024"


def test_a_recipe_is_for_its_own_task(tmp_path):
    assert config_source(None, []) == default_config_path()
    assert config_source(None, ["task.name=temporal_clue"]) == default_config_path()
    # another task starts from the config classes' defaults: no Temporal Clue shaping inherited
    assert config_source(None, ["task.name=examples.my_task:problems"]) is None
    cfg = load_config(config_source(None, ["task.name=math"]), ["task.name=math"])
    assert (cfg.algorithm.credit, cfg.algorithm.format_reward, cfg.rollout.guided_samples) == ("sequence", 0.0, 0)
    assert config_source("aime_lora", []) == recipes()["aime_lora"]
    mine = tmp_path / "aime_lora"
    mine.write_text("loop:\n  iterations: 3\n")
    assert config_source(str(mine), []) == mine  # a file of that name wins over the recipe
    with pytest.raises(UserError, match=r"no config file or recipe 'aime_lor' \(did you mean 'aime_lora'"):
        config_source("aime_lor", [])


def test_split_args():
    assert split_args(["c.yaml", "a.b=1", "c.d=x=y"]) == ("c.yaml", ["a.b=1", "c.d=x=y"])
    assert split_args(["a.b=1"]) == (None, ["a.b=1"])
    with pytest.raises(UserError, match="at most one config file"):
        split_args(["a.yaml", "b.yaml"])


@pytest.mark.parametrize("config", ["temporal_clue_qwen2.5_14b", "aime_lora"])
def test_dry_run_shipped_recipes(config, tiny, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # recipes name shipped data sets, from any folder
    code = main(["train", config, f"model.path={tiny}", "--dry-run"])
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
        (["train", "aime_lora", f"model.path={tiny}", "task.eval_path=/no/such.jsonl",
          "--dry-run"], "cannot read math problem file /no/such.jsonl"),
        (["train", "--dry-run", "algorithm.format_reward=-1"], "algorithm.format_reward"),
        (["train", "--dry-run", "trainer.mini_batches=0"], "trainer.mini_batches"),
        (["train", "--dry-run", "task.temporal_clue.stop_after_sheet=maybe"], "task.temporal_clue.stop_after_sheet"),
        (["train", "--dry-run", "model.lora.last_layers=0"], "model.lora.last_layers"),
        (["train", "--dry-run", "task.difficulty=2"], "'task.difficulty' has moved to 'task.temporal_clue.difficulty'"),
        (["train", "--dry-run", f"model.path={tiny}", "task.name=math", "task.train_path=aime2024",
          "task.temporal_clue.difficulty=2"],
         "task.temporal_clue.difficulty is a temporal_clue setting; task.name is math"),
        (["train", "--dry-run", "algorithm.entropy_coef=-0.01"], "algorithm.entropy_coef"),
        (["train", "--dry-run", "task.temporal_clue.deduction_credit=true", "algorithm.credit=sequence"],
         "task.temporal_clue.deduction_credit=true needs task.temporal_clue.reasoning=deduce and algorithm.credit=answer"),
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


def test_sigterm_inside_an_import_ends_the_process_as_sigterm(tmp_path):
    """A KeyboardInterrupt raised inside an import can break a native library (seen: a Rust
    extension aborting, an interpreter exiting by SIGINT): there the command ends by SIGTERM's own
    default action instead, at once and without a traceback."""
    import signal
    import subprocess
    import sys

    (tmp_path / "slow_native_lib.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(30)\n")
    script = ("import argparse, sys\nimport sleuth.cli as cli\n"
              "def command(args):\n    import slow_native_lib\n    return 0\n"
              "parser = argparse.ArgumentParser()\nparser.set_defaults(func=command)\n"
              "cli.build_parser = lambda: parser\nsys.exit(cli.main([]))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=25)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "Traceback" not in proc.stderr


def test_sigterm_that_a_library_swallows_is_still_an_interrupt(monkeypatch, capsys):
    """SIGTERM raises KeyboardInterrupt wherever the command is; numpy's import once swallowed it
    half-way and failed later with AttributeError: that is exit 130, not a traceback. Any other
    failure still propagates."""
    import argparse
    import signal
    import time

    import sleuth.cli as cli

    def command(args) -> int:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt:
            pass  # swallowed, as inside numpy's import
        raise AttributeError("module 'numpy' has no attribute 'ndarray'")

    parser = argparse.ArgumentParser()
    parser.set_defaults(func=command)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert cli.main([]) == 130
    assert capsys.readouterr().err == "sleuth: interrupted\n"
    parser.set_defaults(func=lambda args: [][0])  # no signal: a real bug still raises
    with pytest.raises(IndexError):
        cli.main([])


def test_console_script_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sleuth", "train", "--dry-run", "loop.iterations=0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("sleuth: error: config key 'loop.iterations'")
    assert json.dumps  # stdout stays empty on errors
    assert proc.stdout == ""


# ---------------------------------------------------------------- reliability: run directories

from test_loop import overrides  # noqa: E402  (the loop tests' settings)


@pytest.fixture(scope="module")
def trained_run(tiny, lowercase_task, tmp_path_factory):
    """A finished 2-iteration run of the tiny model (checkpoints 1 and 2), copied by each test."""
    from io import StringIO

    from sleuth.loop.train import train

    root = tmp_path_factory.mktemp("trained")
    args = [*overrides(tiny, lowercase_task, iterations=2), "loop.evaluate=false"]
    cfg = load_config(recipes()["temporal_clue_direct"], args)
    cfg.task.temporal_clue = TemporalClueConfig()  # the recipe's Temporal Clue settings: none is the user task's
    train(cfg, root / "run", out=StringIO())
    return root / "run"


def copy_run(run: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(run, dest)
    return dest


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("sleuth: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_new_run_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    out = tmp_path / "mine"
    (out / "model").mkdir(parents=True)
    (out / "model" / "weights.bin").write_bytes(b"precious")
    (out / "config.yaml").write_text("my: own\n")
    assert main(["train", "--out", str(out), "loop.iterations=1"]) == 2
    assert "is not empty and is not a sleuth run" in one_error_line(capsys.readouterr().err)
    assert (out / "model" / "weights.bin").read_bytes() == b"precious"
    assert (out / "config.yaml").read_text() == "my: own\n"
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model"]
    only_config = tmp_path / "stopped"
    only_config.mkdir()
    (only_config / "config.yaml").write_text("loop: {}\n")
    assert main(["train", "--out", str(only_config)]) == 2
    assert "a run stopped before its first iteration); continue it with --resume" in \
        one_error_line(capsys.readouterr().err)
    file_out = tmp_path / "afile"
    file_out.write_text("x")
    assert main(["train", "--out", str(file_out)]) == 2
    assert "is a file, not a folder" in one_error_line(capsys.readouterr().err)


def test_a_locked_run_is_refused_naming_the_holder(trained_run, tmp_path, capsys):
    run = copy_run(trained_run, tmp_path / "run")
    code = ("import sys; from sleuth.system.fsio import FolderLock; FolderLock(sys.argv[1]).acquire(); "
            "print('locked', flush=True); sys.stdin.readline()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = read_tree(run)
        assert main(["train", "--resume", str(run)]) == 2
        assert f"in use by another sleuth process (pid {holder.pid})" in one_error_line(capsys.readouterr().err)
        assert read_tree(run) == before
    finally:
        holder.kill()
        holder.wait()


def read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def test_failed_resume_never_rewrites_the_config(trained_run, tmp_path, capsys):
    run = copy_run(trained_run, tmp_path / "run")
    before = read_tree(run)
    for bad in ("trainer.lr=-1", "algorithm.advantage=grop"):  # invalid: refused when the config loads
        assert main(["train", "--resume", str(run), bad]) == 2
        assert bad.split("=")[0] in one_error_line(capsys.readouterr().err)
    assert main(["train", "--resume", str(run), f"model.path={tmp_path / 'gone'}"]) == 2  # fails at start
    assert "is neither a folder nor a known alias" in one_error_line(capsys.readouterr().err)
    assert read_tree(run) == before


def test_resume_refuses_a_planted_pickle_and_runs_nothing(trained_run, tmp_path, capsys):
    """A crafted trainer.pt (with a manifest to match) must not execute on --resume."""
    import pickle

    from sleuth.run.checkpoint import write_manifest

    run = copy_run(trained_run, tmp_path / "run")
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for ckpt in (run / "checkpoints").iterdir():
        (ckpt / "trainer.pt").write_bytes(pickle.dumps({"optimizer": Exploit()}))
        (ckpt / "manifest.json").unlink()
        write_manifest(ckpt)
    before = read_tree(run)
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "none of the 2 checkpoints" in one_error_line(err)
    assert "only code execution could load; refused" in err
    assert not marker.exists()
    assert read_tree(run) == before


def test_user_code_lists_every_key_that_names_code(tmp_path):
    data = {"task": {"name": "temporal_clue", "verifier": None, "episode": {"rollout": "my_agent:rollout"}},
            "algorithm": {"advantage": "grpo", "loss": f"{tmp_path}/l.py:loss"}}
    assert user_code(data) == ["task.episode.rollout=my_agent:rollout (module my_agent)",
                               f"algorithm.loss={tmp_path}/l.py:loss ({tmp_path}/l.py)"]
    assert user_code({"task": {"episode": "not a section"}, "algorithm": None}) == []


def test_resume_announces_user_code_before_importing_it(trained_run, lowercase_task, tmp_path, capsys):
    """A run directory's config names code; --resume says which before anything imports it."""
    run = copy_run(trained_run, tmp_path / "run")
    marker = tmp_path / "imported"
    planted = tmp_path / "planted.py"
    planted.write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef problems(cfg):\n    return []\n")
    config = run / "config.yaml"
    config.write_text(config.read_text().replace(str(lowercase_task), str(planted)))
    main(["train", "--resume", str(run), "--dry-run"])  # the start-up checks import it (no problems: an error)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"sleuth: note: {config} names code that this run imports and runs: "
                      f"task.name={planted}:problems ({planted})")
    assert marker.exists()  # checking the config's names imports it: hence the note before
