"""`sleuth sft [CONFIG.yaml] [key=value ...] [--out RUN_DIR] [--resume RUN_DIR]`: supervised warm start."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from sleuth.system import fsio

if TYPE_CHECKING:
    from sleuth.config import Config
    from sleuth.loop.sft import SftResult


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sft",
        help="supervised warm start on solver-written Temporal Clue deductions (then: sleuth train model.init=RUN_DIR sft.warm_start=false)",
        description="Fine-tune on freshly generated Temporal Clue puzzles (seeds disjoint from every held-out "
        "set) whose target is the solver's short deduction followed by the answer sheet, with the prompt in "
        "task.temporal_clue.reasoning=deduce form. Settings: the sft section (steps, time_budget_min, batch_tokens, lr, "
        "difficulty, seed), model and trainer. Start RL from the result with `sleuth train "
        "model.init=RUN_DIR sft.warm_start=false` (the main job's recipe; its own warm start is this command).",
    )
    p.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value",
                   help="an optional config file, then dotted overrides such as sft.steps=50")
    p.add_argument("--out", metavar="RUN_DIR", help="run directory (default runs/sft-<date-time>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the SFT run in RUN_DIR from its latest checkpoint")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sleuth.cli.train import check_new_run_dir, config_and_run_dir, create_run_dir
    from sleuth.loop.sft import sft_config

    cfg, run_dir = config_and_run_dir(args, "sft-%Y%m%d-%H%M%S")
    cfg = sft_config(cfg)  # a task other than temporal_clue fails here, before any loading
    from sleuth.tasks.temporal_clue.generate import check_difficulty

    check_difficulty(cfg.sft.difficulty, "sft.difficulty")
    create_run_dir(run_dir)
    with fsio.FolderLock(run_dir):
        if not args.resume:
            check_new_run_dir(run_dir)  # again under the lock
        return _sft(cfg, run_dir, bool(args.resume))


def _sft(cfg: Config, run_dir: Path, resume: bool) -> int:
    from sleuth.loop.budget import process_age_s
    from sleuth.loop.sft import sft

    print(f"run directory: {run_dir}", file=sys.stderr)
    command_line = sys.argv[1:2] == ["sft"]
    result = sft(cfg, run_dir, resume=resume, elapsed_before_s=process_age_s() if command_line else 0.0)
    if result.interrupted:
        signum = result.stop_signal or signal.SIGINT
        print(f"sleuth: interrupted after step {result.steps}; checkpoint saved. "
              f"Continue with: sleuth sft --resume {run_dir}", file=sys.stderr)
        return 128 + int(signum)
    print(f"sft: {_steps_text(cfg, run_dir, result)}; start RL with: sleuth train "
          f"model.init={run_dir} task.temporal_clue.reasoning=deduce rollout.max_tokens={cfg.rollout.max_tokens}")
    print(f"steps={result.steps}")
    return 0


def _steps_text(cfg: Config, run_dir: Path, result: SftResult) -> str:
    """The steps taken and their loss; why the run stopped short of sft.steps, and how to go on."""
    if result.first_loss is None or result.last_loss is None:  # the losses are this call's steps'
        text = f"{result.steps} steps (none in this call)"
    else:
        text = f"{result.steps} steps, loss {result.first_loss:.4f} -> {result.last_loss:.4f}"
    if result.budget_spent:
        text += (f"; sft.time_budget_min={cfg.sft.time_budget_min:g} ended it before sft.steps={cfg.sft.steps} "
                 f"(to go on: sleuth sft --resume {run_dir} sft.time_budget_min=null)")
    return text
