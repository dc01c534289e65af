"""How long `sleuth report` takes on a big run: 1,000 iterations and 10,000 sample completions.

    .venv/bin/python bench/report.py [--iterations 1000] [--samples 10000] [--repeat 3] [--smoke]

Writes a synthetic run directory (through MetricsWriter, every metric the loop logs, validation
every 10 iterations, samples of ~1,500 characters), then times the `sleuth report` command end to
end in a fresh process (interpreter start and imports included, as a user sees it), and the stages
in-process. Target: under 10 s. Last line: `report_s=<median seconds of the command>`. --smoke: 20
iterations, 20 samples, one command run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _smoke import add_smoke_flag
from sleuth.config import Config, LoggingConfig, dump_config
from sleuth.run.metrics import MetricsWriter
from sleuth.system.hardware import cpu_description


def write_run(run_dir: Path, iterations: int, samples: int, eval_every: int = 10) -> None:
    rng = np.random.default_rng(0)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(Config()))
    evals = max(1, iterations // eval_every)
    per_eval = max(1, samples // evals)
    words = ["the", "clue", "suspect", "weapon", "room", "so", "therefore", "<answer>", "</answer>", "&"]
    with MetricsWriter(run_dir, LoggingConfig(tensorboard=False)) as w:
        for it in range(iterations):
            m = {  # the loop's metric names (sleuth.run.metrics)
                "rollout/reward_mean": float(np.clip(0.2 + 0.5 * (it / iterations) ** 0.5 + rng.normal(0, 0.05), 0, 1)),
                "train/loss": float(rng.normal(0, 0.1)), "train/kl": 0.001 * it / iterations,
                "train/entropy": 1.5 - it / iterations, "train/clip_frac_low": float(rng.uniform(0, 0.02)),
                "train/clip_frac_high": float(rng.uniform(0, 0.03)), "train/grad_norm": float(rng.uniform(0.1, 2)),
                "rollout/completion_tokens_mean": 300 + 0.2 * it, "rollout/tokens": 64 * 300,
                "time/rollout_s": float(rng.uniform(20, 30)), "time/score_s": 0.5,
                "time/train_s": float(rng.uniform(10, 15)), "time/sync_s": 1.0,
            }
            if it % eval_every == 0:
                m["val/reward"] = 0.1 * (it + 1) ** 0.3
                w.log_samples(it, [
                    {"problem_id": f"p{j // 2}", "reward": float(j % 2 == 0), "kind": "best" if j % 2 == 0 else "worst",
                     "text": " ".join(rng.choice(words, size=250))} for j in range(per_eval)])
            w.log(it, m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--samples", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=3)
    add_smoke_flag(ap)
    a = ap.parse_args()
    if a.smoke:
        a.iterations, a.samples, a.repeat = 20, 20, 1
    print(f"# cpu: {cpu_description()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        write_run(run, a.iterations, a.samples)
        n_samples = sum(1 for _ in (run / "samples.jsonl").open())
        size_mb = sum(f.stat().st_size for f in run.iterdir()) / 1e6

        from sleuth.eval.plots import run_plots
        from sleuth.eval.report import load_run, render_html

        t0 = time.perf_counter()
        data = load_run(run)
        t1 = time.perf_counter()
        plots, fit = run_plots(data.metrics)
        t2 = time.perf_counter()
        render_html("bench", data, plots, fit, [], 40)
        t3 = time.perf_counter()

        times = []
        for _ in range(a.repeat):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "sleuth", "report", str(run), "--out", str(Path(tmp) / "out")],
                           check=True, capture_output=True)
            times.append(time.perf_counter() - start)
        page_mb = (Path(tmp) / "out" / "report.html").stat().st_size / 1e6

    print(f"run: {a.iterations} iterations, {n_samples} samples, {size_mb:.1f} MB on disk")
    print(f"{'stage':<34}{'seconds':>10}")
    print(f"{'read metrics + samples + config':<34}{t1 - t0:>10.2f}")
    print(f"{f'{len(plots)} plots (matplotlib, Agg)':<34}{t2 - t1:>10.2f}")
    print(f"{'render report.html':<34}{t3 - t2:>10.2f}")
    print(f"{'`sleuth report` command, median':<34}{statistics.median(times):>10.2f}"
          f"   (runs: {', '.join(f'{t:.2f}' for t in times)}; report.html {page_mb:.1f} MB)")
    print(f"report_s={statistics.median(times):.2f}")


if __name__ == "__main__":
    main()
