"""The ladder below difficulty 1, rung by rung: generation time, size, prompt tokens, and what
answers that ignore the puzzle score on the held-out set a run would use.

    .venv/bin/python bench/ladder.py [--n 200] [--rungs lookup,elim1,elim2,1] [--smoke]

Per rung, over the first N generated held-out puzzles (seeds 1, 3, 5, ..., as `task.eval_size=N
task.temporal_clue.eval_difficulty=RUNG` evaluates them, choices listed in their shuffled orders): generation
seconds per puzzle (wall, one process), clues, questions, prompt tokens (SmolLM2's tokenizer, the
chat template included), the deepest answer's propagation depth (`propagate.depths`; "-" beyond
the rung language), the chance level (uniformly random listed choices), the best constant answer
(the first, second or last listed choice on every line) and the share of right answers listed
first. `--smoke` uses 3 puzzles per rung and the tiny model's tokenizer. The last line holds
name=value pairs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from sleuth.config import load_config
from sleuth.eval.stats import chance_level, constant_level
from sleuth.system.hardware import cpu_description
from sleuth.system.models import encode_chat, load_tokenizer, resolve_model_path
from sleuth.tasks.curriculum import level_name, parse_level
from sleuth.tasks.registry import build_task
from sleuth.tasks.temporal_clue.generate import build_puzzle
from sleuth.tasks.temporal_clue.propagate import depths
from sleuth.tasks.temporal_clue.task import eval_seed


def measure(rung: str, n: int, tokenizer: object) -> dict[str, float | str]:
    start = time.perf_counter()
    task = build_task(load_config(None, [f"task.temporal_clue.eval_difficulty={rung}", f"task.eval_size={n}",
                                         "task.temporal_clue.list_choices=true"]).task)
    problems = task.eval_problems()
    per_puzzle_s = (time.perf_counter() - start) / n
    puzzles = [build_puzzle(eval_seed(j), rung) for j in range(n)]
    deepest = Counter()
    for p in puzzles:
        found = depths(p.setting, p.clues, p.questions)
        deepest["-" if found is None or None in found else max(d for d in found if d is not None)] += 1
    tokens = [len(encode_chat(tokenizer, p.messages)) for p in problems]
    first = [p.metadata["choices"][q][0] == a for p in problems for q, a in p.answer.items()]
    return {"rung": level_name(parse_level(rung)), "s_per_puzzle": per_puzzle_s,
            "clues": statistics.mean(len(p.clues) for p in puzzles),
            "questions": statistics.mean(len(p.questions) for p in puzzles),
            "tokens_mean": statistics.mean(tokens), "tokens_max": max(tokens),
            "depth": " ".join(f"{k}:{v}" for k, v in sorted(deepest.items(), key=str)),
            "chance": chance_level(task, problems) or 0.0, "constant": constant_level(task, problems) or 0.0,
            "first_right": sum(first) / len(first)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="held-out puzzles per rung")
    parser.add_argument("--rungs", default="lookup,elim1,elim2,1", help="comma-separated rungs or difficulties")
    parser.add_argument("--smoke", action="store_true", help="3 puzzles per rung, the tiny model's tokenizer")
    args = parser.parse_args()
    if args.n < 1:
        parser.error(f"--n {args.n}: expected at least 1 puzzle")
    rungs = [r.strip() for r in args.rungs.split(",") if r.strip()]
    print(f"# cpu: {cpu_description()}", flush=True)
    if args.smoke:
        from sleuth.testing.tiny_model import write_tiny_model

        n, tokenizer = 3, load_tokenizer(str(write_tiny_model(Path(tempfile.mkdtemp()) / "tiny")))
    else:
        n, tokenizer = args.n, load_tokenizer(str(resolve_model_path("smollm2-135m-instruct")))
    print(f"{'rung':>7} {'n':>4} {'s/puzzle':>8} {'clues':>5} {'questions':>9} {'tokens':>6} {'max':>5} "
          f"{'chance':>6} {'constant':>8} {'first_right':>11}  deepest answer (depth:puzzles)")
    rows = []
    for rung in rungs:
        r = measure(rung, n, tokenizer)
        rows.append(r)
        print(f"{r['rung']:>7} {n:>4} {r['s_per_puzzle']:>8.3f} {r['clues']:>5.1f} {r['questions']:>9.1f} "
              f"{r['tokens_mean']:>6.0f} {r['tokens_max']:>5} {r['chance']:>6.3f} {r['constant']:>8.3f} "
              f"{r['first_right']:>11.3f}  {r['depth']}", flush=True)
    print(" ".join(f"{r['rung']}_tokens={r['tokens_mean']:.0f} {r['rung']}_constant_minus_chance="
                   f"{float(r['constant']) - float(r['chance']):.3f}" for r in rows))


if __name__ == "__main__":
    main()
