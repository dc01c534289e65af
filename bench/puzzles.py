"""Temporal Clue generator speed: seconds and clues per puzzle at difficulty 1, 3 and 6, one process.

    .venv/bin/python bench/puzzles.py [--n 50] [--seed 0] [--smoke]

The published generator took a median of ~1.9 s and a mean of ~34 s per puzzle at up to 6 players
on the development machine (tail past 4 minutes); the target is 10x faster on both at difficulty 6,
with no puzzle over 10 s. Wall and CPU seconds are both shown: on a shared machine wall time
grows with the load, CPU time of this single-threaded process much less. The last line holds
the headline figures as name=value pairs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _smoke import add_smoke_flag
from sleuth.system.hardware import cpu_description
from sleuth.tasks.temporal_clue.generate import build_puzzle, puzzle_seed

PUBLISHED_MEDIAN_S, PUBLISHED_MEAN_S = 1.9, 34.0


def measure(difficulty: int, n: int, seed: int) -> tuple[list[float], list[float], list[int], list[int]]:
    """Wall seconds, CPU seconds (this process), clues and CP-SAT solves per puzzle."""
    seconds, cpu, clues, solves = [], [], [], []
    for i in range(n):
        start, start_cpu = time.perf_counter(), time.process_time()
        puzzle = build_puzzle(puzzle_seed(seed, i), difficulty)
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        clues.append(len(puzzle.clues))
        solves.append(puzzle.selection.solves)
    return seconds, cpu, clues, solves


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50, help="puzzles per difficulty")
    parser.add_argument("--seed", type=int, default=0)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # one puzzle per difficulty
        args.n = 1
    print(f"# cpu: {cpu_description()}", flush=True)
    headline: dict[str, float] = {}
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'difficulty':>10} {'n':>4} {'median_s':>9} {'mean_s':>8} {'p95_s':>7} {'max_s':>7} "
          f"{'cpu_med_s':>9} {'cpu_mean_s':>10} {'cpu_max_s':>9} {'clues_med':>9} {'clues_max':>9} {'solves_mean':>11}")
    for difficulty in (1, 3, 6):
        seconds, cpu, clues, solves = measure(difficulty, args.n, args.seed)
        row = {"median": statistics.median(seconds), "mean": statistics.mean(seconds), "p95": p95(seconds),
               "max": max(seconds)}
        print(f"{difficulty:>10} {args.n:>4} {row['median']:>9.3f} {row['mean']:>8.3f} {row['p95']:>7.3f} "
              f"{row['max']:>7.3f} {statistics.median(cpu):>9.3f} {statistics.mean(cpu):>10.3f} {max(cpu):>9.3f} "
              f"{statistics.median(clues):>9.0f} {max(clues):>9} {statistics.mean(solves):>11.1f}", flush=True)
        headline[f"d{difficulty}_median_s"] = row["median"]
        if difficulty == 6:
            headline.update({"d6_mean_s": row["mean"], "d6_p95_s": row["p95"], "d6_max_s": row["max"],
                             "d6_cpu_median_s": statistics.median(cpu), "d6_cpu_mean_s": statistics.mean(cpu),
                             "d6_cpu_max_s": max(cpu)})
    print(f"d6 vs published (wall): median {PUBLISHED_MEDIAN_S / headline['d6_median_s']:.1f}x faster, "
          f"mean {PUBLISHED_MEAN_S / headline['d6_mean_s']:.1f}x faster")
    print(f"d6 vs published (cpu): median {PUBLISHED_MEDIAN_S / headline['d6_cpu_median_s']:.1f}x faster, "
          f"mean {PUBLISHED_MEAN_S / headline['d6_cpu_mean_s']:.1f}x faster")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(" ".join(f"{k}={v:.3f}" for k, v in headline.items()))


if __name__ == "__main__":
    main()
