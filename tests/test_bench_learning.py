"""bench/learning.py's command line: bad flags exit 2 with a one-line error before any run starts."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from sleuth.cli.train import default_config_path, recipes
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


def _learning():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import learning
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return learning


def arm(name: str, *extra: str):
    """An arm's config as run_arm's command line gives it: its recipe, then its overrides."""
    recipe, *overrides = _learning().ARMS[name]
    return load_config(recipes()[recipe], [*overrides, *extra])


def test_every_arm_is_a_valid_config_over_its_recipe():
    """Each arm's overrides load over its recipe (known keys, valid values), as the run_arm command
    line passes them; a typo in an arm would otherwise surface minutes into a run."""
    learning = _learning()
    assert set(learning.DEFAULT_ARMS.split(",")) <= set(learning.ARMS)
    for name in learning.ARMS:
        assert arm(name, "loop.time_budget_min=15", "loop.seed=1").loop.seed == 1, name
    assert arm("default") == load_config(default_config_path())  # the main job as it is now
    assert arm("no_warm_start").sft.warm_start is False and arm("default").sft.warm_start is True
    # the recipe's earlier RL lr, everything else the default's
    assert arm("rl_lr_3e-6") == arm("default").model_copy(update={
        "trainer": arm("default").trainer.model_copy(update={"lr": 3e-6})}) and arm("default").trainer.lr == 3e-5
    direct = load_config(recipes()[learning.DIRECT])
    kl = arm("kl")
    assert kl.algorithm.kl_beta == 0.04 and kl.trainer.lr == direct.trainer.lr
    # `earlier` is the direct recipe before `sheet`'s levers joined it; `sheet` before LoRA went to
    # the last 15 layers (`top`).
    earlier = arm("earlier")
    assert (earlier.algorithm.credit, earlier.algorithm.format_reward, earlier.trainer.mini_batches,
            earlier.task.temporal_clue.stop_after_sheet) == ("sequence", 0.0, 1, False)
    sheet = arm("sheet")
    assert sheet.model.lora.last_layers is None and earlier.model.lora.last_layers is None
    # `top` is the direct recipe before `guided` joined it: the same, without the guided sample.
    top = arm("top")
    assert top == load_config(recipes()[learning.DIRECT], ["rollout.guided_samples=0"])
    assert sheet == load_config(recipes()[learning.DIRECT], ["rollout.guided_samples=0", "model.lora.last_layers=null"])
    # The entropy arms change only the bonus of the default they were measured over (`top`).
    for name, coef in (("entropy", 0.01), ("entropy_small", 0.001)):
        cfg = arm(name)
        assert cfg.algorithm.entropy_coef == coef and top.algorithm.entropy_coef == 0
        assert cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"entropy_coef": 0.0})}) == top
    # `guided` is the direct recipe: `top` with one guided sample in each group of eight.
    guided = arm("guided")
    assert guided == direct == arm("direct")
    assert guided.rollout.guided_samples == 1 and guided.rollout.samples_per_task == 8
    assert guided.model_copy(update={"rollout": guided.rollout.model_copy(update={"guided_samples": 0})}) == top


def test_smoke_runs_the_paired_diagnostics_on_the_tiny_model(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--diagnostics", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("# cpu: ")
    headline = dict(item.split("=") for item in lines[-1].split())
    assert set(headline) == {"final_val", "chance", "minutes", "gain_se"}, lines[-1]
    # every headline a number; the gain over its standard error may be 0/0 when one iteration changes nothing
    assert all(not math.isnan(float(v)) or k == "gain_se" for k, v in headline.items())
    summary = (tmp_path / "default-seed0" / "eval-diagnostics" / "summary.json").read_text()
    assert '"ablate_clues"' in summary and '"permute_options"' in summary


def test_ladder_arm_climbs_the_rungs_and_holds_out_difficulty_one():
    cfg = arm("ladder")
    assert cfg.task.temporal_clue.difficulty.startswith("lookup ->") and cfg.task.temporal_clue.eval_difficulty == 1
    assert cfg.task.temporal_clue.curriculum_fade == 8
