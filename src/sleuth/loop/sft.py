"""`sleuth sft`: a supervised warm start on solver-written deductions (Temporal Clue).

    result = sft(cfg, run_dir, resume=False)     # cfg.sft: steps / time_budget_min, batch_tokens, lr, ...

Each step takes the next freshly generated puzzles (rung cfg.sft.difficulty; seeds disjoint from
every held-out set, see tasks/temporal_clue/sft_data.py) until the batch holds cfg.sft.batch_tokens
prompt and target tokens; the target is the solver's deduction then the answer sheet
(tasks/temporal_clue/deduce.py). The step (train/sft.py) packs them like the RL step's groups and
minimizes the mean token NLL of the targets with the trainer's optimizer at cfg.sft.lr, on the
policy of train/policy.py (LoRA or full).

The run directory is a run like `sleuth train`'s: config.yaml (task.temporal_clue.reasoning recorded as deduce
and rollout.max_tokens at least DEDUCE_MAX_TOKENS, so `sleuth eval --model RUN_DIR` poses the same
prompts and leaves room for the deduction), metrics.jsonl (one row per step),
checkpoints/ (sleuth/run/checkpoint.py: weights, optimizer and schedule, RNG states, the next puzzle
index and the budget). `--resume` continues from the latest checkpoint and gives the same weights
as an uninterrupted run. `sleuth train model.init=RUN_DIR` starts RL from the result
(run/init.py).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from sleuth.config import Config, dump_config
from sleuth.errors import ConfigError
from sleuth.system import fsio


@dataclass
class SftResult:
    steps: int
    first_loss: float | None
    last_loss: float | None
    interrupted: bool = False
    stop_signal: int = 0
    budget_spent: bool = False
    """sft.time_budget_min ended the run before sft.steps (a resume with a larger budget, or none, goes on)."""


DEDUCE_MAX_TOKENS = 512
"""The least rollout.max_tokens an SFT run records, so that `sleuth eval --model RUN_DIR` leaves room
for the deduction: a difficulty-1 target (deduction and sheet) is ~190 SmolLM2 tokens."""


def sft_config(cfg: Config) -> Config:
    """The config an SFT run records and runs: Temporal Clue in deduce form, with room to write it."""
    if cfg.task.name != "temporal_clue":
        raise ConfigError(f"sleuth sft trains on Temporal Clue deductions; task.name is {cfg.task.name}")
    rollout = cfg.rollout.model_copy(update={"max_tokens": max(cfg.rollout.max_tokens, DEDUCE_MAX_TOKENS)})
    tc = cfg.task.temporal_clue.model_copy(update={"reasoning": "deduce"})
    return cfg.model_copy(update={"task": cfg.task.model_copy(update={"temporal_clue": tc}), "rollout": rollout})


def sft(cfg: Config, run_dir: Path, resume: bool = False, elapsed_before_s: float = 0.0,
        out: TextIO | None = None) -> SftResult:
    """Run (or continue) supervised fine-tuning into `run_dir`."""
    from sleuth.loop.budget import TimeBudget
    from sleuth.run.checkpoint import CheckpointManager
    from sleuth.run.interrupt import InterruptFlag
    from sleuth.run.metrics import MetricsWriter
    from sleuth.system.hardware import reproducible_cpu_math, resolve_dtype
    from sleuth.system.seeds import seed_everything
    from sleuth.tasks.temporal_clue.sft_data import PuzzleStream
    from sleuth.train.optim import build_optimizer
    from sleuth.train.policy import Policy
    from sleuth.train.sft import OptimizerState, pack_examples, sft_step

    out = out or sys.stderr
    cfg = sft_config(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    budget = TimeBudget(cfg.sft.time_budget_min, elapsed_before_s)
    if cfg.loop.deterministic:
        reproducible_cpu_math()
    seed_everything(cfg.sft.seed, 0, cfg.loop.deterministic)
    model_cfg = cfg.model.model_copy(update={"dtype": resolve_dtype(cfg.model.dtype)})
    policy = Policy.from_config(model_cfg, need_reference=False)
    stream = PuzzleStream(cfg, policy.tokenizer)
    trainer_cfg = cfg.trainer.model_copy(update={"lr": cfg.sft.lr})
    state = OptimizerState(*build_optimizer(policy.trainable_parameters(), trainer_cfg, cfg.sft.steps))
    checkpoints = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.loop.keep_checkpoints)
    step, index = 0, 0
    latest = checkpoints.restore_latest(policy, state) if resume else None
    if cfg.model.init is not None and latest is None:  # e.g. a second SFT stage on another rung
        from sleuth.run.init import load_init

        print(f"model.init: starting from {load_init(policy, cfg.model)}", file=out)
    if latest is not None:
        step, index = int(latest.state["iteration"]), int(latest.state["next_puzzle"])
        budget.restore(latest.state.get("budget"))
        if (latest.path / "metrics.jsonl").exists():
            fsio.write_bytes(run_dir / "metrics.jsonl", (latest.path / "metrics.jsonl").read_bytes())
    fsio.write_text(run_dir / "config.yaml", dump_config(cfg))
    pad = 128 if policy.attn_backend == "flex_attention" else 1
    losses: list[float] = []
    saved_at = step
    with MetricsWriter(run_dir, cfg.logging) as writer, InterruptFlag() as flag:
        if resume:
            writer.truncate_after(step if latest is not None else -1)

        def save() -> None:
            checkpoints.save(step, policy, state, {"next_puzzle": index, "budget": budget.state()},
                             metrics_file=writer.metrics_path)

        while step < cfg.sft.steps and budget.allows_next() and not flag.requested:
            t0 = time.perf_counter()
            examples, index = stream.batch(index, cfg.sft.batch_tokens)
            metrics = sft_step(policy, state, pack_examples(examples, cfg.trainer.row_tokens, pad),
                               cfg.trainer.grad_clip)
            step += 1
            seconds = time.perf_counter() - t0
            budget.record(seconds)
            losses.append(metrics["sft/loss"])
            writer.log(step, {**metrics, "sft/puzzles": len(examples), "sft/next_puzzle": index,
                              "time/step_s": seconds, "time/elapsed_min": budget.elapsed_s() / 60})
            print(f"sft step {step}/{cfg.sft.steps}: loss {metrics['sft/loss']:.4f}, {len(examples)} puzzles, "
                  f"{metrics['sft/target_tokens']} target tokens, {seconds:.1f}s", file=out)
            if cfg.sft.checkpoint_every and step % cfg.sft.checkpoint_every == 0:
                save()
                saved_at = step
        if step > saved_at or (step == 0 and latest is None):
            save()
    first = losses[0] if losses else None
    spent = step < cfg.sft.steps and not flag.requested
    return SftResult(step, first, losses[-1] if losses else None, flag.requested, flag.signum, spent)


DONE_FILE = "done.json"


def warm_start(cfg: Config, run_dir: Path, resume: bool, elapsed_before_s: float = 0.0,
               out: TextIO | None = None) -> SftResult | None:
    """sft.warm_start: the SFT phase of `sleuth train`, in RUN_DIR/sft. Skipped (None) when it
    finished before (its done.json) or RL has already checkpointed; continued from its own
    checkpoint after an interruption (an interrupted phase's result says so: the caller stops)."""
    import json

    from sleuth.run.checkpoint import CheckpointManager
    from sleuth.run.init import warm_start_dir

    sft_dir = warm_start_dir(run_dir)
    if (sft_dir / DONE_FILE).is_file() or (resume and CheckpointManager(run_dir / "checkpoints").newest_valid()):
        return None
    continuing = resume and (sft_dir / "checkpoints").is_dir()
    print(f"warm start: sleuth sft at {cfg.sft.difficulty} into {sft_dir}" + (" (continued)" if continuing else ""),
          file=out or sys.stderr, flush=True)
    result = sft(cfg, sft_dir, resume=continuing, elapsed_before_s=elapsed_before_s, out=out)
    if result.interrupted:
        return result
    fsio.write_text(sft_dir / DONE_FILE, json.dumps({"steps": result.steps, "first_loss": result.first_loss,
                                                     "last_loss": result.last_loss}) + "\n")
    loss = "" if result.first_loss is None else f", loss {result.first_loss:.4f} -> {result.last_loss:.4f}"
    print(f"warm start: {result.steps} steps{loss}", file=out or sys.stderr, flush=True)
    return result
