import json
import re
import shutil
from io import StringIO

import pytest

from sleuth.cli import main
from sleuth.config import load_config
from sleuth.eval.stats import pass_at_k
from sleuth.loop.train import train
from sleuth.testing.tiny_model import write_tiny_model

TASK_SOURCE = '''
def problems(cfg):
    for i in range(20):
        yield {"id": f"p{i}", "prompt": f"Say something ({i})", "answer": None,
               "split": "eval" if i < 4 else "train"}


def verify(answer, text):
    # 1 for a completion that is mostly lowercase letters, else the fraction: some samples of a
    # random model reach 1 now and then, so pass@k and avg@k differ.
    share = sum("a" <= c <= "z" for c in text) / len(text) if text else 0.0
    return 1.0 if share >= 0.25 else share
'''

COMMON = ["task.eval_size=4", "task.verifier_isolation=inline", "rollout.engine=hf",
          "rollout.max_tokens=6", "model.dtype=float32"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    tiny = write_tiny_model(root / "tiny")
    task_file = root / "say_task.py"
    task_file.write_text(TASK_SOURCE)
    return tiny, task_file


def test_eval_model_folder(files, tmp_path, capsys):
    tiny, task_file = files
    out = tmp_path / "out"
    code = main(["eval", "--model", str(tiny), "--task", f"{task_file}:problems", "--k", "3",
                 "--price", "2.5", "--out", str(out), *COMMON])
    stdout = capsys.readouterr().out
    assert code == 0
    last = stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"avg@3=\d\.\d{4} pass@3=\d\.\d{4} maj@3=\d\.\d{4}", last), last

    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert len(samples) == 4 * 3
    by_problem: dict[str, list[float]] = {}
    for s in samples:
        by_problem.setdefault(s["problem_id"], []).append(s["reward"])
        assert s["tokens"] <= 6
    avgs = [sum(r) / 3 for r in by_problem.values()]
    assert summary["avg"] == pytest.approx(sum(avgs) / 4)
    assert summary["pass_k"] == pytest.approx(
        sum(pass_at_k(3, sum(x >= 1 for x in r), 3) for r in by_problem.values()) / 4)
    assert summary["mean_completion_tokens"] == pytest.approx(sum(s["tokens"] for s in samples) / 12)
    assert summary["cost_per_problem"] == pytest.approx(summary["tokens_per_problem"] * 2.5 / 1e6)
    assert summary["tokens_per_problem"] > 3 * summary["mean_completion_tokens"]  # prompts count too
    assert last == f"avg@3={summary['avg']:.4f} pass@3={summary['pass_k']:.4f} maj@3={summary['maj']:.4f}"
    assert summary["constant"] is None and "best constant answer" not in stdout  # this task has none
    assert summary["constant_margin"] is None
    assert f"avg@3     {summary['avg']:.4f} ± {summary['avg_se']:.4f}".split() == \
        next(line for line in stdout.splitlines() if line.startswith("avg@3 ")).split()

    # Same seed, same numbers: evaluation is reproducible.
    assert main(["eval", "--model", str(tiny), "--task", f"{task_file}:problems", "--k", "3",
                 "--out", str(tmp_path / "again"), *COMMON]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == last


def test_eval_prints_the_best_constant_answer_of_temporal_clue(files, tmp_path, capsys):
    """End to end: on a task with constant answers the table and summary.json give the best one's
    mean reward next to the chance level: what a policy that ignores the puzzles would score."""
    from sleuth.cli.train import config_source
    from sleuth.eval.stats import constant_level, constant_margin
    from sleuth.tasks.registry import build_task

    tiny, _ = files
    out = tmp_path / "out"
    overrides = ["task.eval_size=3", "rollout.engine=hf", "rollout.max_tokens=4", "model.dtype=float32"]
    assert main(["eval", "--model", str(tiny), "--task", "temporal_clue", "--k", "1", "--out", str(out),
                 *overrides]) == 0
    stdout = capsys.readouterr().out
    given = ["task.name=temporal_clue", *overrides]  # the main job's recipe underneath, as `sleuth eval` reads it
    task = build_task(load_config(config_source(None, given), given).task)
    want = constant_level(task, task.eval_problems())
    summary = json.loads((out / "summary.json").read_text())
    assert want is not None and summary["constant"] == pytest.approx(want)
    assert summary["chance"] < summary["constant"] <= 1.0
    assert f"best constant answer    {want:.4f}".split() in [line.split() for line in stdout.splitlines()]
    # and the policy against that answer, paired per puzzle, as `sleuth train` prints it
    name, diff, se = constant_margin(task, task.eval_problems()[:3], summary["per_problem"])
    assert summary["constant_margin"] == {"answer": name, "difference": pytest.approx(diff),
                                          "difference_se": pytest.approx(se)}
    line = f"against the best constant answer ({name}): {diff:+.3f} ± {se:.3f}"
    assert any(row.startswith(line) and row.endswith("SE, paired)") for row in stdout.splitlines())


def test_eval_prints_kinds_difficulty_and_paired_diagnostics(files, tmp_path, capsys):
    """--ablate-clues and --permute-options evaluate the same held-out puzzles changed, with the same
    sampling seeds, and report the per-problem paired difference; the table names the held-out
    difficulty and gives accuracy per question kind."""
    tiny, _ = files
    out = tmp_path / "out"
    overrides = ["task.eval_size=4", "task.temporal_clue.eval_difficulty=elim1", "rollout.engine=hf", "rollout.max_tokens=4",
                 "model.dtype=float32"]
    assert main(["eval", "--model", str(tiny), "--task", "temporal_clue", "--k", "2", "--out", str(out),
                 "--ablate-clues", "--permute-options", *overrides]) == 0
    stdout = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["difficulty"] == "elim1" and "held-out difficulty     elim1" in stdout
    assert 0 <= summary["first_choice"] <= 1 and "first listed choice" in stdout
    assert list(summary["per_kind"])[:3] == ["who", "weapon", "where"]
    assert summary["per_kind"]["who"]["problems"] == 4
    lines = stdout.splitlines()
    assert any(line.split()[:2] == ["who", "4"] for line in lines)
    d = summary["diagnostics"]
    assert set(d) == {"ablate_clues", "permute_options"}
    for name, title in (("ablate_clues", "clues removed"), ("permute_options", "options permuted")):
        diffs = [b - a for a, b in zip(summary["per_problem"], d[name]["per_problem"])]
        assert d[name]["difference"] == pytest.approx(sum(diffs) / 4)
        assert any(line.startswith(f"{title}: avg@2 ") and "paired difference" in line for line in lines)
    assert d["ablate_clues"]["mean_prompt_tokens"] < summary["mean_prompt_tokens"] - 20
    assert abs(d["permute_options"]["mean_prompt_tokens"] - summary["mean_prompt_tokens"]) < 10
    assert main(["eval", "--model", str(tiny), "--task", str(files[1]) + ":problems", "--ablate-clues",
                 "--out", str(tmp_path / "o2"), *COMMON]) == 2
    assert "--ablate-clues needs a task with clues" in capsys.readouterr().err


def test_eval_table_gives_the_best_constant_answer_next_to_the_chance_level(capsys, tmp_path):
    """On a task with constant answers (Temporal Clue's held-out set: the first listed choice on
    every line scores 0.5140 with the choices in their shuffled orders (the second listed on every
    line; 0.4926 for the first before the orders were shuffled), chance 0.3968) the table names the best
    one's mean reward."""
    from sleuth.cli.eval import _print_table
    from sleuth.cli.train import recipes
    from sleuth.eval.stats import chance_level, constant_level
    from sleuth.tasks.registry import build_task

    task = build_task(load_config(recipes()["temporal_clue_direct"]).task)  # 16 puzzles at difficulty 1
    problems = task.eval_problems()
    s = {"problems": 16, "avg": 0.458, "avg_se": 0.05, "pass_k": 0.06, "pass_se": 0.06, "maj": 0.47,
         "maj_se": 0.05, "chance": chance_level(task, problems), "constant": constant_level(task, problems),
         "mean_completion_tokens": 43.5, "tokens_per_problem": 3086, "verifier_errors": 0,
         "cost_per_problem": 0.0, "price_per_million_tokens": 0.0}
    _print_table(s, 4, tmp_path)
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["chance", "level", "0.3968"] in lines and ["best", "constant", "answer", "0.5140"] in lines
    _print_table(s | {"constant": None}, 4, tmp_path)
    assert "best constant answer" not in capsys.readouterr().out


def test_eval_run_directory_uses_its_config_and_checkpoint(files, tmp_path, capsys):
    tiny, task_file = files
    cfg = load_config(None, [f"model.path={tiny}", "model.lora.rank=4", f"task.name={task_file}:problems",
                             "loop.iterations=1", "loop.tasks_per_iteration=2", "rollout.samples_per_task=2",
                             "eval.k=2", "logging.tensorboard=false", *COMMON])
    run = tmp_path / "run"
    train(cfg, run, out=StringIO())
    shutil.rmtree(run / "model")  # as if the run was stopped early: eval merges the latest checkpoint
    assert main(["eval", "--model", str(run)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("avg@2=")
    outs = list(run.glob("eval-*-k2/summary.json"))
    assert len(outs) == 1
    summary = json.loads(outs[0].read_text())
    assert summary["task"] == f"{task_file}:problems" and summary["problems"] == 4


def test_eval_bad_inputs(files, tmp_path, capsys):
    tiny, _task_file = files
    cases = [
        (["eval", "--model", str(tmp_path / "missing"), "--task", "temporal_clue"], "is neither a folder"),
        (["eval", "--model", str(tiny), "--task", "temporal_clu"], "unknown task 'temporal_clu'"),
        (["eval", "--model", str(tiny), "--k", "0"], "--k (eval.k): Input should be greater than or equal to 1"),
        (["eval", "--model", str(tiny), "--k", "true"], "--k (eval.k): expected a number, not a boolean"),
        (["eval", "--model", str(tiny), "--price", "nan"], "--price (eval.price_per_million_tokens): Input "
                                                            "should be a finite number"),
        (["eval", "--model", str(tiny), "--price", "-1"], "--price (eval.price_per_million_tokens)"),
        (["eval", "--model", str(tiny), "--out", str(tiny / "config.json")], "is a file, not a folder"),
        (["eval", "--model", str(tiny), "eval.kk=3"], "unknown config key 'eval.kk'"),
        (["eval", "--model", str(tiny), "notakey"], "not of the form section.key=value"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("sleuth: error: ") and message in err[-1], err


FAILING_TASK = TASK_SOURCE.replace("def verify(answer, text):", "def verify(answer, text):\n    return '1.0'")


def test_eval_says_when_every_verifier_call_failed(files, tmp_path, capsys):
    tiny, _ = files
    task_file = tmp_path / "failing_task.py"
    task_file.write_text(FAILING_TASK)  # the verifier returns the string "1.0", not a number
    out = tmp_path / "out"
    assert main(["eval", "--model", str(tiny), "--task", f"{task_file}:problems", "--k", "2",
                 "--out", str(out), *COMMON]) == 0
    err = capsys.readouterr().err
    assert "sleuth: warning: every verifier call of the evaluation failed (8 of 8); the first: verifier " \
           "returned str, not a number" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verifier_errors"] == 8 and summary["avg"] == 0.0
    assert summary["warning"].startswith("every verifier call")


def test_output_folder_names_are_safe_and_readable(tmp_path):
    from pathlib import Path

    from sleuth.cli.eval import _default_out, task_slug

    assert task_slug("../toy_task.py:problems") == "toy_task-problems"
    assert task_slug("examples.my_task:problems") == "my_task-problems"
    assert task_slug("temporal_clue") == "temporal_clue"
    assert task_slug("verifiers:my_env") == "verifiers_my_env"
    assert task_slug("openenv:http://127.0.0.1:8000") == "openenv_http-127.0.0.1_8000"
    assert task_slug("my tasks/t 1.py:go") == "t_1-go"
    assert _default_out("/m/Qwen2.5-14B-Instruct", "../toy_task.py:problems", 4) == \
        Path("evals/Qwen2.5-14B-Instruct-toy_task-problems-k4")
    assert not task_slug("/x/.hidden.py:f").startswith(".")
    assert len(task_slug("t" * 200)) == 60


def test_eval_never_writes_over_earlier_results_or_a_run(files, tmp_path, capsys):
    tiny, task_file = files
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(f"task:\n  name: {task_file}:problems\nmodel:\n  path: {tiny}\n")
    (run / "samples.jsonl").write_text('{"kept": true}\n')
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "summary.json").write_text("{}")
    samples_only = tmp_path / "samples_only"
    samples_only.mkdir()
    (samples_only / "samples.jsonl").write_text("{}\n")
    metrics_only = tmp_path / "metrics_only"
    metrics_only.mkdir()
    (metrics_only / "metrics.jsonl").write_text("{}\n")
    task = ["--task", f"{task_file}:problems"]
    cases = [(run, "is a run directory (it holds metrics.jsonl)" if (run / "metrics.jsonl").exists()
              else "is a run directory (it holds checkpoints)"),
             (earlier, "already holds an evaluation (summary.json)"),
             (samples_only, "already holds an evaluation (samples.jsonl)"),
             (metrics_only, "is a run directory (it holds metrics.jsonl)")]
    for out, message in cases:
        assert main(["eval", "--model", str(tiny), *task, "--out", str(out), *COMMON]) == 2, out
        assert message in capsys.readouterr().err
    assert (run / "samples.jsonl").read_text() == '{"kept": true}\n' and (earlier / "summary.json").read_text() == "{}"
    # the default folder inside a run: a second evaluation with the same settings is refused too
    default = run / "eval-say_task-problems-k2"
    default.mkdir()
    (default / "summary.json").write_text("{}")
    assert main(["eval", "--model", str(run), "--k", "2", *COMMON]) == 2
    assert "(the default; choose one with --out) already holds an evaluation" in capsys.readouterr().err


def test_eval_blames_the_source_of_a_bad_value(files, tmp_path, capsys):
    tiny, task_file = files
    run = tmp_path / "run"
    shutil.copytree(tiny, run / "model")
    (run / "config.yaml").write_text(f"task:\n  name: {tmp_path}/moved_away.py:problems\n")
    assert main(["eval", "--model", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'config.yaml'}: config key 'task.name'" in err and "--task" not in err
    assert main(["eval", "--model", str(run), "--task", f"{tmp_path}/also_missing.py:problems"]) == 2
    assert "--task (task.name)" in capsys.readouterr().err
    (run / "config.yaml").write_text(f"task:\n  name: {task_file}:problems\neval:\n  k: 0\n")
    assert main(["eval", "--model", str(run)]) == 2
    assert f"{run / 'config.yaml'}: config key 'eval.k'" in capsys.readouterr().err
    assert main(["eval", "--model", str(run), "eval.k=-3"]) == 2  # the override is blamed, not the file
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "config key 'eval.k'" in err and "config.yaml" not in err


FAILING_EPISODES = TASK_SOURCE + '''

async def rollout(client, problem):
    raise KeyError("no such field")
'''


def test_eval_counts_and_prints_episode_failures(files, tmp_path, capsys):
    tiny, _ = files
    task_file = tmp_path / "failing_agent.py"
    task_file.write_text(FAILING_EPISODES)
    out = tmp_path / "out"
    assert main(["eval", "--model", str(tiny), "--task", f"{task_file}:problems", "--k", "1",
                 "--out", str(out), *COMMON]) == 0
    captured = capsys.readouterr()
    assert re.search(r"episode failures\s+4 errors, 0 timeouts of 4 episodes", captured.out)
    assert "verifier errors" not in captured.out
    assert "sleuth: warning: every one of the 4 episodes failed" in captured.err
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["episode_errors"], summary["episode_timeouts"], summary["avg"]) == (4, 0, 0.0)
