"""`sleuth eval --model PATH_OR_RUN_DIR --task NAME [--k 8] [key=value ...]`: avg@k, pass@k, maj@k."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from sleuth import fsio
from sleuth.errors import ConfigError, UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="evaluate a model or a run on a task's held-out problems: avg@k, pass@k, maj@k",
        description="Sample k completions per held-out problem and report avg@k, pass@k (unbiased) and "
        "maj@k with standard errors, mean completion tokens and the estimated cost per problem. Every "
        "sample goes to OUT/samples.jsonl, the summary to OUT/summary.json; the last stdout line is "
        "`avg@K=… pass@K=… maj@K=…`.",
    )
    p.add_argument("--model", required=True, metavar="PATH_OR_RUN_DIR",
                   help="an HF model folder, a sleuth run directory, or the alias smollm2-135m-instruct")
    p.add_argument("--task", metavar="NAME", help="task name (default: the run's task, else temporal_clue)")
    p.add_argument("--k", metavar="K", help="samples per problem (default eval.k)")
    p.add_argument("--price", metavar="USD",
                   help="price per million tokens for the cost estimate (default eval.price_per_million_tokens)")
    p.add_argument("--out", metavar="DIR", help="output folder (default RUN_DIR/eval-TASK-kK or evals/MODEL-TASK-kK)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. task.eval_size=30")
    p.set_defaults(func=run)


def is_run_dir(path: Path) -> bool:
    return (path / "config.yaml").is_file() and ((path / "checkpoints").is_dir() or (path / "model").is_dir())


def _base_config(model: str, overrides: list[str]) -> Any:  # -> Config
    from sleuth.cli.train import default_config_path, run_config
    from sleuth.config import load_config

    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise UserError(f"override '{bad[0]}' is not of the form section.key=value")
    if is_run_dir(Path(model)):
        return run_config(model, overrides)
    return load_config(default_config_path(), overrides)


def model_folder(model: str, cfg: Any, scratch: Path) -> Path:
    """A loadable HF folder: a plain folder or alias, RUN_DIR/model, or the run's latest checkpoint
    merged into `scratch`."""
    from sleuth.models import resolve_model_path

    run = Path(model)
    if is_run_dir(run) and not (run / "model" / "config.json").is_file():
        from sleuth.cli.export import export_checkpoint

        return export_checkpoint(run, "latest", scratch / "model", cfg)
    return resolve_model_path(model)


def run(args: argparse.Namespace) -> int:
    from sleuth.cli.train import keep_stdout_for_results
    from sleuth.evaluate import eval_sampling, evaluate, evaluate_episodes
    from sleuth.hardware import resolve_dtype
    from sleuth.models import load_tokenizer
    from sleuth.rollout.factory import engine_kind, make_engine
    from sleuth.scoring import VerifierRunner
    from sleuth.structured import check_structured_output
    from sleuth.tasks.episodes import EpisodeRunner, find_rollout
    from sleuth.tasks.registry import build_task

    keep_stdout_for_results()
    # The flags are config overrides, so they are checked exactly as `train` checks its config
    # (--price nan, --k 0 and --k true are the same one-line errors).
    flags = {"task.name": ("--task", args.task), "eval.k": ("--k", args.k),
             "eval.price_per_million_tokens": ("--price", args.price)}
    overrides = [*args.overrides, *(f"{key}={value}" for key, (_, value) in flags.items() if value is not None)]
    try:
        cfg = _base_config(args.model, overrides)
    except ConfigError as e:
        text = str(e)
        for key, (flag, _) in flags.items():
            text = text.replace(f"config key '{key}'", f"{flag} ({key})")
        raise ConfigError(text) from None
    k = cfg.eval.k
    out = Path(args.out) if args.out else _default_out(args.model, cfg.task.name, k)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder")
    fsio.check_writable(out)  # before the model loads and the samples are drawn
    task = build_task(cfg.task)
    check_structured_output(cfg, task, engine_kind(cfg.rollout))
    problems = list(task.eval_problems())[: cfg.task.eval_size]
    if not problems:
        raise UserError(f"task {cfg.task.name} has no held-out problems")
    scratch = Path(tempfile.mkdtemp(prefix="sleuth-eval-"))
    try:
        folder = model_folder(args.model, cfg, scratch)
        tokenizer = load_tokenizer(str(folder))
        print(f"evaluating {args.model} on {len(problems)} problems of {cfg.task.name}, k={k}", file=sys.stderr)
        engine = make_engine(cfg.rollout, str(folder), resolve_dtype(cfg.model.dtype), cfg.loop.seed)
        try:
            rollout = find_rollout(cfg.task, task)
            if rollout is not None:  # an episode task: avg@k over k episodes per problem
                runner = EpisodeRunner(rollout, engine, tokenizer, cfg.task, eval_sampling(cfg))
                result = evaluate_episodes(runner, problems, k, eval_sampling(cfg), seed=cfg.loop.seed)
            else:
                with VerifierRunner.from_config(task, cfg.task) as verifier:
                    result = evaluate(engine, task, tokenizer, problems, k, eval_sampling(cfg), verifier,
                                      seed=cfg.loop.seed, structured=cfg.rollout.structured_output)
        finally:
            engine.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = result.summary()
    tokens_per_problem = k * (result.mean_prompt_tokens + result.mean_completion_tokens)
    summary.update(
        model=args.model, task=cfg.task.name, tokens_per_problem=tokens_per_problem,
        price_per_million_tokens=cfg.eval.price_per_million_tokens,
        cost_per_problem=tokens_per_problem * cfg.eval.price_per_million_tokens / 1e6,
    )
    summary[f"avg@{k}"], summary[f"pass@{k}"], summary[f"maj@{k}"] = result.avg, result.pass_k, result.maj
    if result.warning:
        print(f"sleuth: warning: {result.warning}", file=sys.stderr)
    with fsio.atomic_file(out / "samples.jsonl") as f:
        for rec in result.records:
            f.write(json.dumps(rec) + "\n")
    fsio.write_text(out / "summary.json", json.dumps(summary, indent=1))
    _print_table(summary, k, out)
    print(f"avg@{k}={result.avg:.4f} pass@{k}={result.pass_k:.4f} maj@{k}={result.maj:.4f}")
    return 0


def _default_out(model: str, task: str, k: int) -> Path:
    path = Path(model)
    if is_run_dir(path):
        return path / f"eval-{task_slug(task)}-k{k}"
    return Path("evals") / f"{_slug(path.name or model)}-{task_slug(task)}-k{k}"


def task_slug(task: str) -> str:
    """A safe, readable folder-name part for a task: "temporal_clue", or for a user task
    "path/to/toy_task.py:problems" / "examples.toy_task:problems" -> "toy_task-problems"."""
    name = task.strip()
    if ":" in name:
        module, _, function = name.rpartition(":")
        stem = Path(module).stem if module.endswith(".py") else module.rsplit(".", 1)[-1]
        name = f"{stem}-{function}"
    return _slug(name)


def _slug(text: str) -> str:
    """Letters, digits, '_', '-' and single inner dots; no leading dot (hidden) and at most 60."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", text)
    slug = re.sub(r"\.{2,}", "_", slug).strip("_.-")
    return slug[:60].rstrip("_.-") or "model"


def _print_table(s: dict[str, Any], k: int, out: Path) -> None:
    chance = "unknown" if s["chance"] is None else f"{s['chance']:.4f}"
    rows = [
        ("problems", f"{s['problems']}"),
        (f"avg@{k}", f"{s['avg']:.4f} ± {s['avg_se']:.4f}"),
        (f"pass@{k}", f"{s['pass_k']:.4f} ± {s['pass_se']:.4f}"),
        (f"maj@{k}", f"{s['maj']:.4f} ± {s['maj_se']:.4f}"),
        ("chance level", chance),
        *([("best constant answer", f"{s['constant']:.4f}")] if s.get("constant") is not None else []),
        ("mean completion tokens", f"{s['mean_completion_tokens']:.1f}"),
        ("tokens per problem", f"{s['tokens_per_problem']:.0f}"),
        ("verifier errors", f"{s['verifier_errors']} of {s['problems'] * k} samples"),
        ("cost per problem", f"${s['cost_per_problem']:.6f} at ${s['price_per_million_tokens']:g}/M tokens"),
        ("samples", str(out / "samples.jsonl")),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
