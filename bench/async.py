"""Synchronous vs one-step overlap vs fully asynchronous training on long-tailed completions.

    .venv/bin/python bench/async.py [--iterations 12] [--tasks 8] [--max-tokens 192] [--engine hf|vllm]
        [--rollout-workers N [--cpus-per-worker C]] [--smoke]

Runs the real loop (sleuth.loop.train.train, the rollout engine in process, LoRA; with
--rollout-workers N >= 2, N rollout workers as Ray actors on a local cluster, C CPUs and C torch
threads each, the trainer in this process) three times
on the same workload: `loop.max_staleness=0` (synchronous), `loop.max_staleness=1` (batch-level
overlap, one step off-policy) and `loop.streaming=true` with `loop.max_staleness=2` (groups streamed
through a buffer, weight updates in flight: between decoding steps in the transformers engine, as
partial rollouts in vLLM, whose samples in flight resume with the new weights). The model is sleuth.testing.tiny_model (random init,
byte-level vocabulary); the task rewards lowercase letters, and completions stop at any digit
(`rollout.stop` = the ten digits), so their lengths are geometric: most are short, a few run to
max_tokens (10x and more between the 10th and the 90th percentile), the long tail that holds a
synchronous batch back. Evaluation is off; the clock is the loop's (`time/iteration_s` summed).

Per mode: wall seconds per trained group, and the fraction of that wall time the trainer and the
generator were idle: synchronous and one-step modes from the step times (trainer idle = 1 - train
time / wall, generator idle = 1 - generation time / wall), streaming from its own counters
(`time/trainer_idle_s`, `time/generator_idle_s`). Prints a table and one `name=value` line.
--smoke: 3 iterations of 2 problems x 2 samples x 16 tokens (figures mean nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from io import StringIO
from pathlib import Path

from _smoke import add_smoke_flag, tiny_model_folder
from sleuth.config import load_config
from sleuth.loop.train import train
from sleuth.run.metrics import read_metrics
from sleuth.system.hardware import cpu_description
from sleuth.testing.tasks import lowercase_task_source

TASK = lowercase_task_source(5000, 2)

MODES = {
    "sync": ["loop.max_staleness=0"],
    "one_step": ["loop.max_staleness=1"],
    "streaming": ["loop.max_staleness=2", "loop.streaming=true"],
}


def run_mode(name: str, extra: list[str], args: argparse.Namespace, root: Path, task: Path) -> dict[str, float]:
    overrides = [
        f"model.path={tiny_model_folder()}", "model.dtype=float32", "model.lora.rank=4", "model.lora.alpha=8",
        "model.lora.last_layers=null", f"task.name={task}:problems", "task.verifier_isolation=inline",
        "algorithm.credit=sequence", "algorithm.format_reward=0", "algorithm.drop_zero_advantage=false",
        "trainer.mini_batches=1", "trainer.lr=0.001", f"rollout.engine={args.engine}",
        f"rollout.samples_per_task={args.samples}", f"rollout.max_tokens={args.max_tokens}",
        "rollout.stop=['0','1','2','3','4','5','6','7','8','9']",
        f"loop.iterations={args.iterations}", f"loop.tasks_per_iteration={args.tasks}", "loop.evaluate=false",
        "loop.checkpoint_every=0", "logging.tensorboard=false",
        *(["rollout.kv_cache_gb=0.1"] if args.engine == "vllm" else []),
        *([f"cluster.rollout_workers={args.rollout_workers}", f"cluster.cpus_per_worker={args.cpus_per_worker}",
           "cluster.object_store_gb=1"] if args.rollout_workers > 1 else []), *extra,
    ]
    run_dir = root / name
    start = time.perf_counter()
    train(load_config(None, overrides), run_dir, out=StringIO())
    total = time.perf_counter() - start
    rows = [r for r in read_metrics(run_dir) if r.get("iteration", 0) > 0]
    wall = sum(r["time/iteration_s"] for r in rows)
    groups = sum(len(r.get("rollout/positions", [])) for r in rows)
    if name == "streaming":
        trainer_idle = sum(r["time/trainer_idle_s"] for r in rows) / wall
        generator_idle = sum(r["time/generator_idle_s"] for r in rows) / wall
    else:
        trainer_idle = 1 - sum(r["time/train_s"] for r in rows) / wall
        generator_idle = max(0.0, 1 - sum(r["time/rollout_s"] for r in rows) / wall)
    return {"s_per_group": wall / max(groups, 1), "trainer_idle": trainer_idle, "generator_idle": generator_idle,
            "groups": float(groups), "wall_s": wall, "run_s": total,
            "tokens_mean": sum(r["rollout/completion_tokens_mean"] for r in rows) / len(rows),
            "truncated": sum(r["rollout/truncated_frac"] for r in rows) / len(rows),
            "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in rows),
            "partial": sum(r.get("rollout/partial_frac", 0.0) for r in rows) / len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--tasks", type=int, default=8, help="loop.tasks_per_iteration")
    parser.add_argument("--samples", type=int, default=4, help="rollout.samples_per_task")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="rollout.engine (vllm: merged LoRA synced "
                        "as full weights, in flight as partial rollouts)")
    parser.add_argument("--rollout-workers", type=int, default=1,
                        help="rollout workers as Ray actors (1: the engine in this process)")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0, help="cluster.cpus_per_worker")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.rollout_workers < 1 or args.cpus_per_worker <= 0:
        parser.error("--rollout-workers must be at least 1 and --cpus-per-worker above 0")
    if args.smoke:
        args.iterations, args.tasks, args.samples, args.max_tokens = 3, 2, 2, 16
    print(f"# {cpu_description()}; {args.iterations} iterations x {args.tasks} problems x {args.samples} samples, "
          f"max {args.max_tokens} tokens, stop at a digit, {args.engine} engine"
          + (f", {args.rollout_workers} Ray rollout workers x {args.cpus_per_worker} CPU"
             if args.rollout_workers > 1 else ", in process"), file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="sleuth-bench-async-") as tmp:
        root = Path(tmp)
        task = root / "lowercase_task.py"
        task.write_text(TASK)
        results = {name: run_mode(name, extra, args, root, task) for name, extra in MODES.items()}
    print("| mode | s / trained group | trainer idle | generator idle | groups | loop s | tokens / completion "
          "| truncated | staleness max | partial |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['s_per_group']:.3f} | {r['trainer_idle']:.2f} | {r['generator_idle']:.2f} | "
              f"{r['groups']:.0f} | {r['wall_s']:.1f} | {r['tokens_mean']:.1f} | {r['truncated']:.2f} | "
              f"{r['staleness_max']:.0f} | {r['partial']:.2f} |")
    sync = results["sync"]["s_per_group"]
    print(" ".join([
        *(f"{name}_s_per_group={r['s_per_group']:.4f}" for name, r in results.items()),
        *(f"{name}_trainer_idle={r['trainer_idle']:.3f}" for name, r in results.items()),
        f"one_step_speedup={sync / results['one_step']['s_per_group']:.3f}",
        f"streaming_speedup={sync / results['streaming']['s_per_group']:.3f}",
    ]))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # the table alone on stdout
    main()
