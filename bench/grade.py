"""Benchmark: the Temporal Clue grader on 100 kB completions (target: under 10 ms each), and the
cost of running verifiers through sleuth.rewards.verifier (worker process vs inline).

    .venv/bin/python bench/grade.py [--calls 50] [--smoke]

Completions: realistic reasoning text with and without an answer sheet at the end, and
adversarial ones (a marker on every few characters, one huge line, unicode). Prints ms per call
(median, max) for each; then the scoring cost per completion for one iteration's worth (512
completions of ~1 kB); then one headline line: grade_100kb_ms=<median, realistic input with its
answer sheet>, the median without one (a full scan), the worst adversarial median, and the
per-completion scoring overheads.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _smoke import add_smoke_flag
from sleuth.records import Completion, Group, Problem
from sleuth.rewards.verifier import VerifierRunner, score_groups
from sleuth.system.hardware import cpu_description
from sleuth.tasks.temporal_clue import grade
from sleuth.tasks.temporal_clue.task import TemporalClueTask

SOLUTION = {
    "A": "Mrs. White", "B": "Lead Pipe", "C": "Drawing Room", "D": "11:45 PM",
    "E": "Courtyard", "F": "Sgt. Gray", "G": "Fountain", "H": "Jealousy",
}
SIZE = 100_000


def _fill(unit: str, tail: str = "") -> str:
    return (unit * (SIZE // len(unit) + 1))[: SIZE - len(tail)] + tail


def inputs() -> dict[str, str]:
    sheet = "\n".join(f"{k}. {v}" for k, v in SOLUTION.items())
    prose = (
        "Mrs. White moved from the Kitchen to the Library at 03:00 AM, so she could not have been "
        "alone with Mr. Boddy in the Drawing Room at 11:45 PM. A. maybe Sgt. Gray? B: no.\n"
    )
    return {
        "reasoning+sheet": _fill(prose, "\n" + sheet),
        "reasoning, no sheet": _fill(prose),
        "markers every 3 chars": _fill("A. "),
        "false markers (xB.)": _fill("xB. b. "),
        "markers, then 5 kB prose": _fill("B. ", "\nMrs. White was in the Kitchen at 11:45 PM.\n" * 120),
        "one line, no newline": _fill("x" * 97 + " B."),
        "answers on one line": _fill(" ".join(f"{k}. {v}" for k, v in SOLUTION.items()) + " "),
        "unicode": _fill("Ａ．Ｍｒｓ． Ｗｈｉｔｅ é ✓ "),
        "markdown bold": _fill("**A.** **Mrs. White**\n"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # two calls per input, four groups to score
        args.calls = 2
    print(f"# cpu: {cpu_description()}", flush=True)
    rows = []
    for name, text in inputs().items():
        grade(SOLUTION, text)  # warm-up (regex compile, caches)
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            grade(SOLUTION, text)
            times.append((time.perf_counter() - start) * 1000)
        rows.append((name, len(text), statistics.median(times), max(times)))
    print(f"{'input':<24} {'chars':>8} {'median ms':>10} {'max ms':>8}")
    for name, n, med, mx in rows:
        print(f"{name:<24} {n:>8} {med:>10.2f} {mx:>8.2f}")
    worst = max(r[2] for r in rows[2:])
    per_completion = scoring_overheads(4 if args.smoke else 64)
    print(
        f"grade_100kb_ms={rows[0][2]:.2f} grade_100kb_full_scan_ms={rows[1][2]:.2f} "
        f"grade_100kb_adversarial_worst_ms={worst:.2f} score_process_us={per_completion['process']:.0f} "
        f"score_inline_us={per_completion['inline']:.0f}"
    )


def scoring_overheads(n_groups: int = 64, group_size: int = 8) -> dict[str, float]:
    """Microseconds per completion to score one iteration's groups, per isolation mode."""
    from sleuth.config import TaskConfig

    task = TemporalClueTask(TaskConfig())
    problem = Problem("bench", [{"role": "user", "content": "x" * 2000}], SOLUTION, {})
    text = "Reasoning... " * 70 + "\n" + "\n".join(f"{k}. {v}" for k, v in SOLUTION.items())
    out = {}
    print(f"\n{'scoring mode':<24} {'completions':>11} {'us/completion':>14}")
    for mode in ("process", "inline"):
        with VerifierRunner(task, timeout_s=5.0, isolation=mode) as runner:  # type: ignore[arg-type]
            score_groups(runner, _groups(problem, text, 1, 1))  # start the worker outside the timing
            groups = _groups(problem, text, n_groups, group_size)
            start = time.perf_counter()
            stats = score_groups(runner, groups)
            elapsed = time.perf_counter() - start
        assert stats.reward_mean == 1.0 and stats.verifier_errors == 0
        out[mode] = elapsed / stats.completions * 1e6
        print(f"{mode:<24} {stats.completions:>11} {out[mode]:>14.0f}")
    return out


def _groups(problem: Problem, text: str, n_groups: int, group_size: int) -> list[Group]:
    return [
        Group(problem, [0], [Completion([0], [1], [0.0], "stop", text) for _ in range(group_size)])
        for _ in range(n_groups)
    ]


if __name__ == "__main__":
    main()
