"""bench/learning.py's command line: bad flags exit 2 with a one-line error before any run starts."""

import subprocess
import sys
from pathlib import Path

import pytest

from sleuth.cli.train import default_config_path
from sleuth.config import load_config

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "learning.py"


@pytest.mark.parametrize("flags, message", [
    (["--arms", "default,bogus"], "unknown arm(s) bogus; choose from default,"),
    (["--seeds", "0,x"], "--seeds '0,x': expected comma-separated integers"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, flags, message):
    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, str(SCRIPT), *flags, "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr.splitlines()[-1]
    assert not out.exists()  # nothing was started


def test_every_arm_is_a_valid_config_over_the_default():
    """Each arm's overrides load over the embedded default (known keys, valid values), as the
    run_arm command line passes them; a typo in an arm would otherwise surface minutes into a run."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import learning
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert set(learning.DEFAULT_ARMS.split(",")) <= set(learning.ARMS)
    for name, overrides in learning.ARMS.items():
        cfg = load_config(default_config_path(), [*overrides, "loop.time_budget_min=15", "loop.seed=1"])
        assert cfg.loop.seed == 1, name
    kl = load_config(default_config_path(), learning.ARMS["kl"])
    assert kl.algorithm.kl_beta == 0.04 and kl.trainer.lr == load_config(default_config_path()).trainer.lr
    # `earlier` is the embedded default before `sheet`'s levers became it; `sheet` the default before
    # LoRA went to the last 15 layers (`top`, the default now).
    earlier = load_config(default_config_path(), learning.ARMS["earlier"])
    assert (earlier.algorithm.credit, earlier.algorithm.format_reward, earlier.trainer.mini_batches,
            earlier.task.stop_after_sheet) == ("sequence", 0.0, 1, False)
    sheet = load_config(default_config_path(), learning.ARMS["sheet"])
    assert sheet.model.lora.last_layers is None and earlier.model.lora.last_layers is None
    # `top` is the default before `guided` joined it: the same, without the guided sample.
    top = load_config(default_config_path(), learning.ARMS["top"])
    assert top == load_config(default_config_path(), ["rollout.guided_samples=0"])
    assert sheet == load_config(default_config_path(), ["rollout.guided_samples=0", "model.lora.last_layers=null"])
    # The entropy arms change only the bonus of the default they were measured over (`top`).
    for arm, coef in (("entropy", 0.01), ("entropy_small", 0.001)):
        cfg = load_config(default_config_path(), learning.ARMS[arm])
        assert cfg.algorithm.entropy_coef == coef and top.algorithm.entropy_coef == 0
        assert cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"entropy_coef": 0.0})}) == top
    # `guided` is the embedded default now: `top` with one guided sample in each group of eight.
    guided = load_config(default_config_path(), learning.ARMS["guided"])
    assert guided == load_config(default_config_path()) and load_config(default_config_path(), learning.ARMS["default"]) == guided
    assert guided.rollout.guided_samples == 1 and guided.rollout.samples_per_task == 8
    assert guided.model_copy(update={"rollout": guided.rollout.model_copy(update={"guided_samples": 0})}) == top
