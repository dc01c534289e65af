"""`sleuth train [CONFIG.yaml] [key=value ...] [--out RUN_DIR] [--resume RUN_DIR] [--dry-run]`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from sleuth.errors import UserError
from sleuth.plugins import did_you_mean
from sleuth.system import fsio
from sleuth.system.fsio import LOCK_FILE, TMP_PREFIX

RUN_MARKERS = ("checkpoints", "metrics.jsonl")
"""What makes a folder a run that a new run must not overwrite."""
USER_CODE_KEYS = ("task.name", "task.verifier", "task.episode.rollout", "algorithm.advantage", "algorithm.loss")
"""Config keys whose "module:function" values name code that a run imports."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model with RL on a task (no config: the embedded default, ~15 min on a CPU)",
        description="Train with GRPO-family RL: sample tasks, generate, score, advantages, train, sync "
        "weights, evaluate, checkpoint. Without a config file it runs the embedded default "
        "(SmolLM2-135M-Instruct, full weights, on Temporal Clue: a supervised warm start, then RL at "
        "the elim1 rung) and prints held-out reward at the start and end of RL next to the chance level "
        "and the best constant answer.",
    )
    p.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value",
                   help="an optional config file, then dotted overrides such as trainer.lr=1e-5")
    p.add_argument("--out", metavar="RUN_DIR", help="run directory (default runs/<date-time>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    p.add_argument("--dry-run", action="store_true",
                   help="validate config, data paths and model folder without loading weights, then exit")
    p.set_defaults(func=run)


DEFAULT_RECIPE = "temporal_clue"
"""What `sleuth train` runs with no config file: the main job."""


def recipes() -> dict[str, Path]:
    """The shipped recipes (src/sleuth/recipes/NAME.yaml) by name."""
    folder = Path(str(resources.files("sleuth") / "recipes"))
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def default_config_path() -> Path:
    """The main job's recipe, shipped inside the package."""
    return recipes()[DEFAULT_RECIPE]


def config_source(path: str | None, overrides: list[str]) -> Path | None:
    """The file a run's config starts from: a path or a recipe name as given; with none, the main
    job's recipe, unless the overrides name another task (then the config classes' defaults alone:
    a recipe's settings are for its own task)."""
    if path is not None:
        if path in recipes() and not Path(path).exists():
            return recipes()[path]
        if not Path(path).exists() and "/" not in path and not path.endswith((".yaml", ".yml")):
            raise UserError(f"no config file or recipe '{path}'{did_you_mean(path, recipes())}; "
                            f"recipes: {', '.join(recipes())}")
        return Path(path)  # load_config names a file it cannot read
    task = [o.partition("=")[2].strip() for o in overrides if o.partition("=")[0].strip() == "task.name"]
    if task and task[-1] != "temporal_clue":
        return None
    return default_config_path()


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
    return load_config(path, overrides, migrate=True)


def dry_run(cfg: Any) -> list[str]:
    """Check everything that can be checked without loading weights; return what was checked."""

    from sleuth.system.models import (
        check_lora_targets,
        check_model_folder,
        converted,
        model_skeleton,
        resolve_model_path,
    )
    lines = [f"model: {check_model_folder(cfg.model.path)}"]
    if cfg.model.init is not None:
        from sleuth.run.init import init_folder

        lines.append(f"model.init: {init_folder(cfg.model)}")
    if cfg.model.lora.enabled and converted(cfg.model.path):  # its modules, from config.json alone
        check_lora_targets(model_skeleton(resolve_model_path(cfg.model.path)), cfg.model.lora.target_modules)
    from sleuth.loop.checks import check_run

    cfg, task = check_run(cfg)  # exactly what the run checks at start-up
    problems = task.eval_problems()
    lines.append(f"task: {cfg.task.name} ({len(problems)} held-out problems, first training problem "
                 f"'{task.train_problem(0).id}')")
    from sleuth.tasks.user import find_rollout

    rollout = find_rollout(cfg.task, task)  # an episode task's function, checked like the verifier
    if rollout is not None:
        lines.append(f"episodes: {getattr(rollout, '__qualname__', rollout)} through the gateway, "
                     f"at most {cfg.task.episode.max_turns} calls each")
    from sleuth.rollout.factory import engine_kind

    engine = engine_kind(cfg.rollout)
    lines.append(f"rollout engine: {engine}")
    from sleuth.system.allocator import allocator_in_use

    lines.append(f"memory allocator: {allocator_in_use()}")
    from sleuth.cluster.plan import describe  # placement and memory plan (joins cluster.address if set)
    from sleuth.system.models import resolve_model_path

    if converted(cfg.model.path):
        lines += architecture_lines(cfg, engine, resolve_model_path(cfg.model.path))
    lines += describe(cfg, engine, resolve_model_path(cfg.model.path))
    L = cfg.loop
    guided = f" ({cfg.rollout.guided_samples} guided)" if cfg.rollout.guided_samples else ""
    lines.append(f"loop: {L.iterations} iterations x {L.tasks_per_iteration} tasks x "
                 f"{cfg.rollout.samples_per_task} samples{guided}, up to {cfg.rollout.max_tokens} tokens each")
    return lines


def architecture_lines(cfg: Any, engine: str, folder: Path) -> list[str]:
    """How this architecture goes through the loop, from config.json alone (no weights loaded):
    the packing mode, the engine's decoding and the weight-sync path."""
    from sleuth.system.attention import linear_attention, one_sequence_per_row, special_attention
    from sleuth.system.models import causal_lm_class, model_config

    config = model_config(folder)
    cls = causal_lm_class(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    special = special_attention(text)
    moe = any(int(getattr(text, k, None) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    kinds = [k for k, on in (("latent attention (MLA)", getattr(text, "kv_lora_rank", None)),
                             ("linear attention", linear_attention(text)), ("mixture of experts", moe)) if on]
    lines = [f"architecture: {cls.__name__} ({text.model_type}{': ' + ', '.join(kinds + special) if kinds + special else ''})"]
    if one_sequence_per_row(text):
        lines.append(f"packing: one sequence per row, prompts not shared ({one_sequence_per_row(text)})")
    else:
        lines.append("packing: prefix trees, shared prompts" + (f" (dense mask where {', '.join(special)} bites)"
                                                                 if special else ""))
    if engine == "hf":
        shared = not (special or linear_attention(text))
        lines.append("decoding: " + ("shared-prompt cache" if shared else "repeated cache per sample ("
                                     + ", ".join(special + (["recurrent state forked"] if linear_attention(text) else []))
                                     + ")"))
    lora = cfg.model.lora.enabled
    native = engine == "hf" or cfg.rollout.native_lora
    if lora and native:
        sync = "LoRA adapter" + (" (full merged weights if PEFT adapts the fused experts)" if moe else "")
    else:
        sync = "full merged weights" if lora else "full weights"
    if engine == "vllm" and moe:
        import torch

        from sleuth.rollout.vllm_weights import full_sync_refusal

        why = full_sync_refusal(json.loads((folder / "config.json").read_text()), not torch.cuda.is_available())
        sync += (f"; vLLM does not follow a full sync of this mixture of experts ({why}): a run needing one "
                 "is refused at start-up") if why else "; full syncs repack vLLM's CPU experts"
    lines.append(f"weight sync: {sync}")
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
        spec: Any = data
        for part in key.split("."):
            spec = spec.get(part) if isinstance(spec, dict) else None
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


def config_and_run_dir(args: argparse.Namespace, stamp: str, check_new: bool = True) -> tuple[Any, Path]:
    """The config and run directory a `train` / `sft` command line names: with --resume RUN_DIR the
    run's config.yaml (overrides only); else a config file or recipe (config_source) and --out or
    runs/<stamp>, a folder that must be new or empty (when check_new)."""
    from sleuth.config import load_config

    config_path, overrides = split_args(args.args)
    if args.resume:
        if config_path is not None:
            raise UserError("--resume takes the config from the run directory; give overrides only")
        if args.out and Path(args.out).resolve() != Path(args.resume).resolve():
            raise UserError("--resume and --out name different run directories")
        return run_config(args.resume, overrides), Path(args.resume)  # written back once the run starts
    cfg = load_config(config_source(config_path, overrides), overrides)
    run_dir = Path(args.out) if args.out else Path("runs") / time.strftime(stamp)
    if check_new:
        check_new_run_dir(run_dir)
    return cfg, run_dir


def create_run_dir(run_dir: Path) -> None:
    """The run directory made (and writable), or one line naming what the environment refuses."""
    fsio.check_writable(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise fsio.environment_error(e, "cannot create the run directory", run_dir) from None


def run(args: argparse.Namespace) -> int:
    from sleuth.config import dump_config
    from sleuth.loop.checks import check_names, check_sections

    cfg, run_dir = config_and_run_dir(args, "%Y%m%d-%H%M%S", check_new=not args.dry_run)
    check_names(cfg)  # before a run directory is written
    check_sections(cfg)
    if args.dry_run:
        for line in dry_run(cfg):
            print(line)
        print("dry run ok: config, data and model folder are valid")
        return 0
    create_run_dir(run_dir)
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
    from sleuth.loop.budget import process_age_s
    from sleuth.loop.train import train

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
