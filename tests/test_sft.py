"""sleuth sft: the examples, the step, the run (checkpoints, exact resume), model.init, bad input."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sleuth.cli import main
from sleuth.cli.train import default_config_path
from sleuth.config import Config, load_config
from sleuth.errors import UserError
from sleuth.loop.sft import sft
from sleuth.run.init import load_init
from sleuth.system.models import load_tokenizer
from sleuth.tasks.temporal_clue.deduce import solution_text
from sleuth.tasks.temporal_clue.generate import build_puzzle, puzzle_record
from sleuth.tasks.temporal_clue.sft_data import SEED_BASE, PuzzleStream, sft_seed
from sleuth.tasks.temporal_clue.task import eval_seed, train_seed
from sleuth.train.optim import build_optimizer
from sleuth.train.policy import Policy
from sleuth.train.sft import OptimizerState, pack_examples, sft_step


def settings(tiny: Path, **sft: object) -> list[str]:
    values = {"steps": 3, "batch_tokens": 16, "lr": 0.01, "checkpoint_every": 1, **sft}
    return [f"model.path={tiny}", "model.dtype=float32", "model.lora.rank=4", "model.lora.alpha=8",
            "logging.tensorboard=false", "loop.deterministic=true", *(f"sft.{k}={v}" for k, v in values.items())]


def config(tiny: Path, **sft: object) -> Config:
    return load_config(None, settings(tiny, **sft))


def test_seeds_never_meet_a_held_out_or_rl_puzzle() -> None:
    seeds = [sft_seed(s, i) for s in range(3) for i in range(300)]
    assert all(s % 2 == 0 and SEED_BASE <= s < 2 * SEED_BASE for s in seeds)
    assert len(set(seeds)) == len(seeds)
    assert all(train_seed(s, i) < SEED_BASE for s in range(3) for i in range(300))
    assert all(eval_seed(j) % 2 == 1 for j in range(300))


def test_a_puzzle_of_the_eval_file_is_skipped(tiny_model_dir: Path, tmp_path: Path) -> None:
    clash = sft_seed(0, 0)
    path = tmp_path / "held_out.jsonl"
    path.write_text(json.dumps(puzzle_record(build_puzzle(clash, 1))) + "\n")
    cfg = load_config(None, [*settings(tiny_model_dir), f"task.eval_path={path}"])
    stream = PuzzleStream(cfg, load_tokenizer(str(tiny_model_dir)))
    assert stream.seed(0) != clash and stream.seed(1) == sft_seed(0, 1)


def test_example_is_the_deduce_prompt_and_the_solution_through_end_of_turn(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model_dir))
    stream = PuzzleStream(config(tiny_model_dir), tokenizer)
    example = stream.example(3)
    puzzle = build_puzzle(sft_seed(0, 3), 1)
    prompt = example.problem.messages[-1]["content"]
    assert f"\n1. {puzzle.clues[0].text(puzzle.setting)}\n" in prompt and "Answers:" in prompt
    assert example.target_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(example.target_ids[:-1]) == solution_text(puzzle)
    assert stream.example(3).target_ids == example.target_ids
    examples, nxt = stream.batch(5, 1)
    assert len(examples) == 1 and nxt == 6


def test_loss_falls_on_a_repeated_batch(tiny_model_dir: Path) -> None:
    cfg = config(tiny_model_dir)
    torch.manual_seed(0)
    policy = Policy.from_config(cfg.model, need_reference=False)
    examples, _ = PuzzleStream(cfg, policy.tokenizer).batch(0, 1)
    batch = pack_examples(examples, cfg.trainer.row_tokens)
    assert batch.n_completion_tokens == sum(len(e.target_ids) for e in examples)  # targets only
    state = OptimizerState(*build_optimizer(policy.trainable_parameters(),
                                            cfg.trainer.model_copy(update={"lr": 0.02}), None))
    losses = [sft_step(policy, state, batch, 1.0)["sft/loss"] for _ in range(6)]
    assert all(b < a for a, b in itertools.pairwise(losses)) and losses[-1] < 0.85 * losses[0], losses


def adapter(run: Path) -> dict[str, torch.Tensor]:
    latest = sorted((run / "checkpoints").glob("iter-*"))[-1]
    return load_file(latest / "policy" / "adapter_model.safetensors")


def test_resume_equals_uninterrupted(tiny_model_dir: Path, tmp_path: Path) -> None:
    whole = sft(config(tiny_model_dir), tmp_path / "whole")
    assert whole.steps == 3 and not whole.interrupted
    sft(config(tiny_model_dir, steps=1), tmp_path / "part")
    cfg = config(tiny_model_dir)  # the same run, told to go on to 3 steps
    resumed = sft(cfg, tmp_path / "part", resume=True)
    assert resumed.steps == 3
    a, b = adapter(tmp_path / "whole"), adapter(tmp_path / "part")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert [r["sft/loss"] for r in rows] == [r["sft/loss"] for r in ref]
    assert [r["sft/next_puzzle"] for r in rows] == [r["sft/next_puzzle"] for r in ref]
    readme = (Path(__file__).parents[1] / "docs" / "usage.md").read_text()
    assert all(f"`{key}`" in readme for r in rows for key in r), "docs/usage.md does not list every sft metric"
    saved = load_config(tmp_path / "whole" / "config.yaml")
    assert saved.task.temporal_clue.reasoning == "deduce" and saved.rollout.max_tokens >= 512


def test_model_init_loads_the_sft_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "sft"
    sft(config(tiny_model_dir, steps=1), run)
    cfg = load_config(None, [*settings(tiny_model_dir), f"model.init={run}"])
    policy = Policy.from_config(cfg.model, need_reference=False)
    folder = load_init(policy, cfg.model)
    saved = load_file(folder / "adapter_model.safetensors")
    mine = {k: v for k, v in policy.model.state_dict().items() if "lora_" in k}
    assert len(saved) == len(mine) > 0
    for name, tensor in saved.items():
        match = [v for k, v in mine.items() if k.replace(".default", "") == name]
        assert len(match) == 1 and torch.equal(match[0], tensor), name
    with pytest.raises(UserError, match=r"rank 4, this run's model\.lora\.rank is 8"):
        other = cfg.model.model_copy(update={"lora": cfg.model.lora.model_copy(update={"rank": 8})})
        load_init(Policy.from_config(other, need_reference=False), other)
    with pytest.raises(UserError, match="no such folder"):
        load_init(policy, cfg.model.model_copy(update={"init": str(tmp_path / "missing")}))
    with pytest.raises(UserError, match=r"trained on model\.path"):
        load_init(policy, cfg.model.model_copy(update={"path": str(tmp_path)}))


def test_train_starts_from_the_sft_result(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    from sleuth.loop.train import setup

    run = tmp_path / "sft"
    sft(config(tiny_model_dir, steps=1), run)
    cfg = load_config(None, [*settings(tiny_model_dir), f"model.init={run}", "task.temporal_clue.reasoning=deduce",
                             "rollout.engine=hf", "task.eval_size=1", "task.verifier_isolation=inline"])
    started = setup(cfg, tmp_path / "rl", resume=False)
    try:
        saved = adapter(run)
        state = {k.replace(".default", ""): v for k, v in started.policy.model.state_dict().items()}
        assert all(torch.equal(state[k], v) for k, v in saved.items())
        assert "model.init: starting from" in capsys.readouterr().err
    finally:
        started.writer.close()
    assert main(["train", "--dry-run", *settings(tiny_model_dir), f"model.init={run}", "sft.warm_start=false"]) == 0
    assert f"model.init: {run}" in capsys.readouterr().out


@pytest.mark.parametrize(("extra", "message"), [
    (["task.name=math"], "sleuth sft trains on Temporal Clue"),
    (["sft.difficulty=99"], "sft.difficulty 99 is outside"),
    (["sft.lr=0"], "sft.lr"),
    (["sft.stepz=3"], "sft.stepz"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_model_dir: Path, tmp_path: Path, capsys, extra, message) -> None:
    assert main(["sft", *settings(tiny_model_dir), *extra, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sleuth: error:") and message in err[0], err
    assert not (tmp_path / "r").exists()


def test_a_spent_budget_says_so_and_a_resume_without_it_goes_on(tiny_model_dir: Path, tmp_path: Path,
                                                               capsys) -> None:
    run = tmp_path / "r"
    # A budget spent before the first step (the model's loading alone takes longer).
    assert main(["sft", *settings(tiny_model_dir, time_budget_min=0.0001), "--out", str(run)]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("sft: 0 steps (none in this call); sft.time_budget_min=0.0001 ended it before "
                           f"sft.steps=3 (to go on: sleuth sft --resume {run} sft.time_budget_min=null)"), line
    assert main(["sft", "--resume", str(run), "sft.time_budget_min=null"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("sft: 3 steps, loss ") and "time_budget_min" not in line, line


def test_resume_of_a_folder_that_is_no_run(tmp_path: Path, capsys) -> None:
    assert main(["sft", "--resume", str(tmp_path)]) == 2
    assert "not a sleuth run directory" in capsys.readouterr().err


def test_a_stop_signal_saves_a_checkpoint_after_the_step(tiny_model_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    from sleuth.train import sft as step_module

    real = step_module.sft_step

    def step_then_sigterm(*args, **kwargs):
        out = real(*args, **kwargs)
        signal.raise_signal(signal.SIGTERM)  # as a scheduler would send it, mid-run
        return out

    monkeypatch.setattr(step_module, "sft_step", step_then_sigterm)
    result = sft(config(tiny_model_dir, checkpoint_every=0), tmp_path / "run")
    assert result.interrupted and result.stop_signal == signal.SIGTERM and result.steps == 1
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("iter-*")] == ["iter-000001"]


def warm_settings(tiny: Path, **sft: object) -> list[str]:
    return [*settings(tiny, **sft), "sft.warm_start=true", "task.temporal_clue.reasoning=deduce", "rollout.engine=hf",
            "task.eval_size=2", "eval.k=1", "eval.ablate_clues=true", "loop.iterations=1", "rollout.max_tokens=8",
            "task.verifier_isolation=inline", "loop.time_budget_min=null"]


def test_train_with_a_warm_start_runs_sft_then_rl_and_the_final_checks(tiny_model_dir: Path, tmp_path: Path,
                                                                        capsys) -> None:
    run = tmp_path / "run"
    assert main(["train", *warm_settings(tiny_model_dir), "--out", str(run)]) == 0
    captured = capsys.readouterr()
    done = json.loads((run / "sft" / "done.json").read_text())
    assert done["steps"] == 3 and "warm start: 3 steps, loss" in captured.out
    assert f"model.init: starting from {run / 'sft'}" in captured.err  # RL began from the SFT weights
    assert re.search(r"warm start: \d+\.\d\d GiB returned to the system", captured.err)  # before RL's model
    assert captured.err.index("returned to the system") < captured.err.index("model.init: starting from")
    assert "against the best constant answer (" in captured.out and "clues removed: " in captured.out
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert "val/ablate_clues/reward" in last
    assert load_config(run / "config.yaml").model.init is None  # the run's config stays as written


def test_a_warm_start_stopped_mid_sft_resumes_into_the_same_weights(tiny_model_dir: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import signal

    from sleuth.train import sft as step_module

    real, calls = step_module.sft_step, []

    def second_step_then_sigterm(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGTERM)
        return out

    monkeypatch.setattr(step_module, "sft_step", second_step_then_sigterm)
    run = tmp_path / "run"
    assert main(["train", *warm_settings(tiny_model_dir), "--out", str(run)]) == 128 + signal.SIGTERM
    assert "Continue with: sleuth train --resume" in capsys.readouterr().err
    assert not (run / "sft" / "done.json").exists() and not (run / "checkpoints").exists()
    monkeypatch.setattr(step_module, "sft_step", real)
    assert main(["train", "--resume", str(run)]) == 0
    assert "(continued)" in capsys.readouterr().out
    sft(load_config(default_config_path(), warm_settings(tiny_model_dir)), tmp_path / "whole")  # uninterrupted
    a, b = (load_file(sorted((r / "checkpoints").glob("iter-*"))[-1] / "policy" / "model.safetensors")
            for r in (tmp_path / "whole", run / "sft"))  # the recipe trains every weight
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (run / "checkpoints").is_dir() and json.loads((run / "sft" / "done.json").read_text())["steps"] == 3


@pytest.mark.parametrize(("extra", "message"), [
    (["model.init=/tmp"], "sft.warm_start trains the start of RL itself"),
    (["task.temporal_clue.reasoning=direct"], "sft.warm_start teaches the deduce form"),
    (["task.name=math"], "sft.warm_start trains on Temporal Clue"),
])
def test_warm_start_bad_input_is_one_line_before_anything_runs(tiny_model_dir: Path, tmp_path: Path, capsys,
                                                               extra: list[str], message: str) -> None:
    assert main(["train", *warm_settings(tiny_model_dir), *extra, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "r" / "sft").exists()
