"""bench/constant_answers.py: constant answer sheets scored on the default's held-out puzzles."""

import json
import subprocess
import sys
from pathlib import Path

from sleuth.cli.train import recipes
from sleuth.config import load_config
from sleuth.tasks.registry import build_task
from sleuth.tasks.temporal_clue.dataset import parse_choices

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "constant_answers.py"


def run(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=300)


def test_scores_constant_sheets_and_the_first_choice_share_of_samples(tmp_path):
    task = build_task(load_config(recipes()["temporal_clue_direct"]).task)  # 16 puzzles at difficulty 1
    held_out = task.eval_problems()
    # A samples.jsonl whose sheets name the first listed choice on every line but question A's.
    rows = []
    for p in held_out:
        choices = p.metadata["choices"]  # as the prompt lists them
        lines = [f"{q}. {opts[-1] if q == 'A' else opts[0]}" for q, opts in sorted(choices.items())]
        rows.append({"problem_id": p.id, "text": "\n".join(lines)})
    samples = tmp_path / "samples.jsonl"
    samples.write_text("\n".join(json.dumps(r) for r in rows))
    proc = run("--recipe", "temporal_clue_direct", "--puzzles", "20", "--samples", str(samples))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0].startswith("# cpu: ")
    n_lines = sum(len(parse_choices(p.messages[-1]["content"])) for p in held_out)
    assert f"{1 - len(held_out) / n_lines:.3f} of {n_lines} answer lines name the first listed choice" in proc.stdout
    last = dict(kv.split("=") for kv in out[-1].split())
    assert set(last) == {"first_heldout", "first_many", "chance_many"}
    # The held-out chance level is the one `sleuth train` prints (0.397); the first listed choice
    # on every line scores 0.327 on these 16 puzzles (0.493 before the choices were shuffled).
    held_row = next(line for line in out if line.startswith("held-out (16)")).split()
    assert held_row[2] == "0.397" and last["first_heldout"] == "0.327"
    first_sheet = {p.id: "\n".join(f"{q}. {o[0]}" for q, o in sorted(p.metadata["choices"].items()))
                   for p in held_out}  # the choices in the order the prompt lists them
    assert abs(sum(task.score(p, first_sheet[p.id]) for p in held_out) / len(held_out) - 0.327) < 5e-4


def test_bad_flags_exit_2_before_scoring(tmp_path):
    proc = run("--recipe", "temporal_clue_direct", "--puzzles", "3")
    assert proc.returncode == 2 and "--puzzles 3: at least the held-out set's 16" in proc.stderr.splitlines()[-1]
    proc = run("--samples", str(tmp_path / "missing.jsonl"))
    assert proc.returncode == 2 and "no such file" in proc.stderr.splitlines()[-1]
    assert "first_heldout" not in proc.stdout
    proc = run("--recipe", "temporal_clue_drect")
    assert proc.returncode == 2 and "--recipe temporal_clue_drect: not a shipped recipe" in proc.stderr.splitlines()[-1]
    stranger = tmp_path / "stranger.jsonl"
    stranger.write_text(json.dumps({"problem_id": "tc-nowhere", "text": "A. x"}) + "\n")
    proc = run("--recipe", "temporal_clue_direct", "--puzzles", "20", "--samples", str(stranger))
    assert proc.returncode == 2 and "problem 'tc-nowhere' is not among the --puzzles puzzles" in proc.stderr
    assert "first_heldout" not in proc.stdout
