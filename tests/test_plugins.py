"""User code named in the config: loading, arity checks, registries, errors at config load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sleuth.config import AlgorithmConfig, TaskConfig, load_config
from sleuth.errors import ConfigError
from sleuth.loop.checks import check_names
from sleuth.plugins import check_arity, load_function, load_object, unknown_name
from sleuth.rewards.advantages import ESTIMATORS, get_advantage, register_advantage
from sleuth.train.losses import LOSSES, get_loss, ppo_clip, register_loss


def test_load_function_checks_arity(tmp_path: Path) -> None:
    mod = tmp_path / "plug_fns.py"
    mod.write_text("def one(r):\n    return r\ndef two(a, b):\n    return a\n"
                   "def var(*args):\n    return args\ndef opt(a, b=1):\n    return a\nNOT_FN = 3\n")
    assert load_function(f"{mod}:one", 1, "advantage", "fn(rewards)")([1]) == [1]
    assert load_function(f"{mod}:var", 6, "loss", "fn(...)")(1, 2) == (1, 2)
    assert load_function(f"{mod}:opt", 1, "advantage", "fn(rewards)")(5) == 5
    with pytest.raises(ConfigError, match=r"advantage '.*:two' takes \(a, b\); expected fn\(rewards\)"):
        load_function(f"{mod}:two", 1, "advantage", "fn(rewards)")
    with pytest.raises(ConfigError, match="is not a function"):
        load_function(f"{mod}:NOT_FN", 1, "advantage", "fn(rewards)")
    with pytest.raises(ConfigError, match="has no 'missing'"):
        load_object(f"{mod}:missing", "advantage")
    with pytest.raises(ConfigError, match="cannot import loss module 'no_such_mod_q'"):
        load_object("no_such_mod_q:f", "loss")
    with pytest.raises(ConfigError, match="takes"):
        check_arity(lambda: 0, 1, "x", "fn(rewards)")


def test_unknown_name_lists_nearest_and_choices() -> None:
    text = unknown_name("advantage", "grop", ["grpo", "rloo", "dr_grpo"])
    assert text.startswith("unknown advantage 'grop' (did you mean 'grpo'")
    assert text.endswith("choose from dr_grpo, grpo, rloo, or module:function")
    assert "did you mean" not in unknown_name("task", "zzzz", ["math"], spec_ok=False)


def test_registered_names_are_valid_in_the_config() -> None:
    @register_advantage("test_plugins_sign")
    def sign(rewards):
        return [1.0 if r > 0 else -1.0 for r in rewards]

    @register_loss("test_plugins_loss")
    def my_loss(logp, old_logp, advantages, token_seq, clip_low, clip_high):
        return ppo_clip(logp, old_logp, advantages, token_seq, clip_low, clip_high)

    try:
        cfg = AlgorithmConfig(advantage="test_plugins_sign", loss="test_plugins_loss")
        assert get_advantage(cfg.advantage) is sign and get_loss(cfg.loss) is my_loss
    finally:
        del ESTIMATORS["test_plugins_sign"], LOSSES["test_plugins_loss"]
    with pytest.raises(ConfigError, match="takes"):
        register_advantage("bad")(lambda a, b: a)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.advantage=grop", r"config key 'algorithm.advantage': unknown advantage 'grop' \(did you mean 'grpo'"),
        ("algorithm.loss=gpso", r"unknown policy loss 'gpso' \(did you mean 'gspo'"),
        ("algorithm.aggregation=token_man", r"'algorithm.aggregation': unknown value 'token_man' \(did you mean 'token_mean'"),
        ("task.name=temporal-clue", r"'task.name': unknown task 'temporal-clue' \(did you mean 'temporal_clue'"),
        ("rollout.engine=vlm", r"'rollout.engine': unknown rollout engine 'vlm' \(did you mean 'vllm'"),
        ("algorithm.advantage=sleuth.train.losses:ppo_clip", r"takes \(logp, .*expected fn\(rewards"),
        ("algorithm.loss=sleuth.rewards.advantages:grpo", r"loss 'sleuth.rewards.advantages:grpo' takes \(rewards\)"),
        ("algorithm.tis_cap=0", "tis_cap': Input should be greater than 0"),
        ("trainer.betas=[0.9,1.5]", "less than 1"),
        ("task.verifier=sleuth.rewards.advantages:grpo", "verifier 'sleuth.rewards.advantages:grpo' takes"),
    ],
)
def test_bad_names_fail_at_the_start_up_check(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_names(load_config(None, [override]))


def test_a_directly_built_config_gets_the_same_error() -> None:
    cfg = load_config(None).model_copy(update={"task": TaskConfig(name="maths")})
    with pytest.raises(ConfigError, match=r"config key 'task\.name': unknown task 'maths'"):
        check_names(cfg)


def test_dry_run_exits_2_on_an_unknown_advantage(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "sleuth.cli", "train", "algorithm.advantage=grop", "--dry-run",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "did you mean 'grpo'" in lines[0]
