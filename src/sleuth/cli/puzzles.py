"""`sleuth puzzles generate | show | stats`: make Temporal Clue puzzle files and look inside them.

Files are read with `sleuth.tasks.temporal_clue.dataset.load_puzzles`, so both our JSONL and the
published JSON list work everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from typing import Any

from sleuth.errors import UserError

MAX_DIFFICULTY = 6


def register(sub: Any) -> None:
    parser = sub.add_parser("puzzles", help="generate, show and summarise Temporal Clue puzzle files")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    gen = actions.add_parser("generate", help="write N puzzles as JSONL (deterministic per seed)")
    gen.add_argument("--n", type=int, default=8, help="number of puzzles (default 8)")
    gen.add_argument("--seed", type=int, default=0, help="batch seed (default 0)")
    gen.add_argument("--difficulty", default="1", metavar="RUNG",
                     help=f"1..{MAX_DIFFICULTY} (players drawn from 1..D), or a rung below 1: lookup (every answer "
                          "stated by a clue), elim1 / elim2 (one / two rounds of elimination); default 1")
    gen.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    gen.add_argument("--out", default="puzzles.jsonl", help="output JSONL file (default puzzles.jsonl)")
    gen.add_argument("--list-choices", action="store_true",
                     help="append ' (choose from: ...)' with the valid answers to every question and describe "
                          "the answer sheet's lines ('A. <name of the suspect>')")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.set_defaults(func=_generate)

    show = actions.add_parser("show", help="print one puzzle's prompt and solution")
    show.add_argument("file", help="JSONL (ours) or JSON list (published) puzzle file")
    show.add_argument("--index", type=int, default=0, help="which puzzle, from 0 (default 0)")
    show.set_defaults(func=_show)

    stats = actions.add_parser("stats", help="counts of sizes, clues and questions in a puzzle file")
    stats.add_argument("file", help="JSONL (ours) or JSON list (published) puzzle file")
    stats.set_defaults(func=_stats)


def _generate(args: argparse.Namespace) -> int:
    if args.n < 1:
        raise UserError(f"--n must be at least 1, got {args.n}")
    from sleuth.tasks.curriculum import level_name
    from sleuth.tasks.temporal_clue.generate import check_difficulty, generate_file

    try:
        level = check_difficulty(args.difficulty)
    except UserError as e:
        raise UserError(f"--{e}") from None
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers must be at least 1, got {args.workers}")

    workers = args.workers or os.cpu_count() or 1
    path = generate_file(args.n, args.seed, level, workers, args.out,
                         list_choices=args.list_choices, progress=not args.quiet)
    print(f"wrote {args.n} puzzles (difficulty {level_name(level)}, seed {args.seed}) to {path}")
    return 0


def _load(path: str) -> list[dict[str, Any]]:
    from sleuth.tasks.temporal_clue.dataset import load_puzzles

    return load_puzzles(path)


def _show(args: argparse.Namespace) -> int:
    puzzles = _load(args.file)
    if not 0 <= args.index < len(puzzles):
        raise UserError(f"--index {args.index} is out of range: {args.file} holds {len(puzzles)} puzzles")
    puzzle = puzzles[args.index]
    print(puzzle["prompt"])
    print()
    print("Solution:")
    for letter, answer in puzzle["solution"].items():
        print(f"{letter}. {answer}")
    return 0


def puzzle_size(prompt: str) -> tuple[int, int, int, int]:
    """(suspects, weapons, rooms, times) read back from a prompt's lists, as the grader reads them
    (published and compact forms alike; 1 time when none is listed)."""
    from sleuth.tasks.temporal_clue.dataset import parse_lists

    lists = parse_lists(prompt)
    return (len(lists.get("SUSPECT", [])), len(lists.get("WEAPON", [])), len(lists.get("ROOM", [])),
            len(lists.get("TIME", [])) or 1)


def _stats(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    puzzles = _load(args.file)
    rows: list[tuple[str, Counter[Any]]] = [
        ("suspects", Counter()), ("weapons", Counter()), ("rooms", Counter()), ("times", Counter()),
        ("clues", Counter()), ("questions", Counter()),
    ]
    for p in puzzles:
        values = [*puzzle_size(p["prompt"]), p.get("num_clues", _count_clues(p["prompt"])), len(p["solution"])]
        for (_, counter), value in zip(rows, values):
            counter[value] += 1
    table = Table(title=f"{args.file}: {len(puzzles)} puzzles")
    for column in ("field", "min", "median", "max", "counts (value: puzzles)"):
        table.add_column(column)
    for name, counter in rows:
        values = sorted(counter.elements())
        if name == "clues":  # too many distinct values to list one by one
            buckets = Counter(_bucket(v) for v in values)
            counts = ", ".join(f"{b}: {c}" for b, c in sorted(buckets.items(), key=lambda bc: int(bc[0].split("-")[0])))
        else:
            counts = ", ".join(f"{v}: {c}" for v, c in sorted(counter.items()))
        table.add_row(name, str(values[0]), str(values[len(values) // 2]), str(values[-1]), counts)
    Console(file=sys.stdout, width=160).print(table)
    kinds: Counter[str] = Counter()
    for p in puzzles:
        kinds.update(p.get("clue_kinds") or {})
    if kinds:
        print("clue kinds: " + json.dumps(dict(kinds.most_common())))
    return 0


def _bucket(clues: int) -> str:
    for low, high in ((0, 5), (6, 10), (11, 20), (21, 50), (51, 100)):
        if clues <= high:
            return f"{low}-{high}"
    return "101-"


def _count_clues(prompt: str) -> int:
    body = prompt.split("clues are as follows:", 1)[-1].split("Please answer", 1)[0]
    return sum(1 for line in body.splitlines() if line.startswith("- "))
