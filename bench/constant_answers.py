"""Constant answers on Temporal Clue: what a policy that ignores the puzzle scores.

    .venv/bin/python bench/constant_answers.py [--recipe temporal_clue] [--puzzles 200] [--samples RUN_DIR/eval-.../samples.jsonl] [--smoke]

A policy can beat the chance level (a uniformly random listed choice on every line, `val/chance`)
without reading the puzzle, by always naming the same position of each question's listed
choices. This scores the first, second and last listed choice on every line against the chance
level, on a recipe's held-out set (--recipe, default the main job's) (its first task.eval_size puzzles) and on --puzzles
puzzles of the same generator (the held-out seeds continued), so a held-out reward can be read
against what a constant answer gets on the same puzzles. With --samples (a `sleuth eval`
samples.jsonl on that held-out set, or on the first N puzzles with `task.eval_size=N`, N up to
--puzzles) it also prints the share of the answer lines that name each question's first listed
choice. Last line: `first_heldout=… first_many=… chance_many=…`. --smoke: --puzzles 16 (the held-out set
alone).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from _smoke import add_smoke_flag
from sleuth.cli.train import DEFAULT_RECIPE, recipes
from sleuth.config import load_config
from sleuth.records import Problem
from sleuth.system.hardware import cpu_description
from sleuth.tasks.base import Task
from sleuth.tasks.registry import build_task
from sleuth.tasks.temporal_clue.dataset import parse_choices
from sleuth.tasks.temporal_clue.task import CONSTANT_ANSWERS

_LINE = re.compile(r"([A-Z])\. (.+)$")


def choices_of(problem: Problem) -> dict[str, list[str]]:
    """Each question's choices in the order the prompt lists them (shuffled per question since the
    choices are listed in a seeded order), else derived from the puzzle."""
    return problem.metadata.get("choices") or parse_choices(problem.messages[-1]["content"])


def constant_scores(task: Task, problems: list[Problem]) -> dict[str, float]:
    """Mean reward of each constant answer sheet (Task.constant_rewards) over the problems."""
    per_problem = [task.constant_rewards(p) or {} for p in problems]
    return {name: sum(r[name] for r in per_problem) / len(problems) for name in CONSTANT_ANSWERS}


def first_choice_share(problems: list[Problem], samples: Path) -> tuple[float, int]:
    """Share of the answer lines in a samples.jsonl that name their question's first listed choice."""
    by_id = {p.id: choices_of(p) for p in problems}
    same = lines = 0
    for row in map(json.loads, samples.read_text().splitlines()):
        choices = by_id.get(row["problem_id"])
        if choices is None:
            raise ValueError(f"--samples {samples}: problem {row['problem_id']!r} is not among the --puzzles puzzles")
        for line in row["text"].splitlines():
            m = _LINE.match(line.strip())
            if m and m.group(1) in choices:
                lines += 1
                same += m.group(2).strip() == choices[m.group(1)][0]
    return same / max(lines, 1), lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--puzzles", type=int, default=200, help="puzzles of the held-out generator to score")
    parser.add_argument("--samples", type=Path, default=None, help="a `sleuth eval` samples.jsonl to compare")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE, help="whose held-out set (a shipped recipe's name)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.recipe not in recipes():
        parser.error(f"--recipe {args.recipe}: not a shipped recipe ({', '.join(recipes())})")  # exit 2
    cfg = load_config(recipes()[args.recipe])
    if args.smoke:
        args.puzzles = cfg.task.eval_size
    if args.puzzles < cfg.task.eval_size:
        parser.error(f"--puzzles {args.puzzles}: at least the held-out set's {cfg.task.eval_size}")  # exit 2
    if args.samples is not None and not args.samples.is_file():
        parser.error(f"--samples {args.samples}: no such file")
    task = build_task(load_config(recipes()[args.recipe], [f"task.eval_size={args.puzzles}"]).task)
    many = task.eval_problems()
    sets = {f"held-out ({cfg.task.eval_size})": many[: cfg.task.eval_size], f"generator ({len(many)})": many}
    print(f"# cpu: {cpu_description()}")
    print(f"{'puzzles':<16} {'chance':>7} " + " ".join(f"{name:>7}" for name in CONSTANT_ANSWERS))
    scores: dict[str, dict[str, float]] = {}
    for label, problems in sets.items():
        row = {"chance": sum(task.chance_reward(p) for p in problems) / len(problems)}
        row |= constant_scores(task, problems)
        scores[label] = row
        print(f"{label:<16} " + " ".join(f"{v:>7.3f}" for v in row.values()))
    if args.samples is not None:
        try:
            share, lines = first_choice_share(many, args.samples)
        except ValueError as e:
            parser.error(str(e))  # exit 2
        print(f"{args.samples}: {share:.3f} of {lines} answer lines name the first listed choice")
    held, gen = scores.values()
    print(f"first_heldout={held['first']:.3f} first_many={gen['first']:.3f} chance_many={gen['chance']:.3f}")


if __name__ == "__main__":
    main()
