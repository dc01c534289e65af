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

from sleuth.errors import ConfigError, UserError
from sleuth.system import fsio


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
                   help="an HF model folder, a sleuth run directory, or an alias "
                        "(smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct)")
    p.add_argument("--task", metavar="NAME", help="task name (default: the run's task, else temporal_clue)")
    p.add_argument("--k", metavar="K", help="samples per problem (default eval.k)")
    p.add_argument("--price", metavar="USD",
                   help="price per million tokens for the cost estimate (default eval.price_per_million_tokens)")
    p.add_argument("--ablate-clues", action="store_true",
                   help="also evaluate the same problems with their clues removed, paired per problem "
                        "(a policy that reads the clues must drop; temporal_clue)")
    p.add_argument("--permute-options", action="store_true",
                   help="also evaluate the same problems with each question's listed choices moved to other "
                        "positions, paired per problem (a policy that reasons must not move; temporal_clue)")
    p.add_argument("--out", metavar="DIR", help="output folder, not a run directory nor one holding an earlier "
                   "evaluation (default RUN_DIR/eval-TASK-kK or evals/MODEL-TASK-kK)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. task.eval_size=30 "
                   "task.temporal_clue.eval_difficulty=elim1 (a task kind's settings are in its task.KIND section)")
    p.set_defaults(func=run)


def is_run_dir(path: Path) -> bool:
    return (path / "config.yaml").is_file() and ((path / "checkpoints").is_dir() or (path / "model").is_dir())


def _base_config(model: str, overrides: list[str]) -> Any:  # -> Config
    from sleuth.cli.train import config_source, run_config
    from sleuth.config import load_config

    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise UserError(f"override '{bad[0]}' is not of the form section.key=value")
    if is_run_dir(Path(model)):
        return run_config(model, overrides)
    return load_config(config_source(None, overrides), overrides)


def model_folder(model: str, cfg: Any, scratch: Path) -> Path:
    """A loadable HF folder: a plain folder or alias, RUN_DIR/model, or the run's latest checkpoint
    merged into `scratch`."""
    from sleuth.system.models import resolve_model_path

    run = Path(model)
    if is_run_dir(run) and not (run / "model" / "config.json").is_file():
        from sleuth.cli.export import export_checkpoint

        return export_checkpoint(run, "latest", scratch / "model", cfg)
    return resolve_model_path(model)


def run(args: argparse.Namespace) -> int:
    from sleuth.cli.train import keep_stdout_for_results
    from sleuth.eval.evaluate import eval_sampling, evaluate, evaluate_episodes
    from sleuth.eval.stats import constant_margin
    from sleuth.gateway.runner import EpisodeRunner
    from sleuth.loop.checks import check_names
    from sleuth.rewards.verifier import VerifierRunner
    from sleuth.rollout.constraints import check_structured_output
    from sleuth.rollout.factory import engine_kind, make_engine
    from sleuth.run.metrics import json_safe
    from sleuth.system.hardware import resolve_dtype
    from sleuth.system.models import load_tokenizer
    from sleuth.tasks.registry import build_task
    from sleuth.tasks.user import find_rollout

    keep_stdout_for_results()
    # The flags are config overrides, so they are checked exactly as `train` checks its config
    # (--price nan, --k 0 and --k true are the same one-line errors).
    flags = {"task.name": ("--task", args.task), "eval.k": ("--k", args.k),
             "eval.price_per_million_tokens": ("--price", args.price)}
    overrides = [*args.overrides, *(f"{key}={value}" for key, (_, value) in flags.items() if value is not None)]
    try:
        cfg = _base_config(args.model, overrides)
        check_names(cfg)
    except ConfigError as e:
        raise ConfigError(_blame_flags(str(e), flags, args.model, list(args.overrides))) from None
    k = cfg.eval.k
    out = Path(args.out) if args.out else _default_out(args.model, cfg.task.name, k)
    check_eval_out(out, bool(args.out))
    fsio.check_writable(out)  # before the model loads and the samples are drawn
    task = build_task(cfg.task)
    check_structured_output(cfg, task, engine_kind(cfg.rollout))
    problems = list(task.eval_problems())[: cfg.task.eval_size]
    if not problems:
        raise UserError(f"task {cfg.task.name} has no held-out problems")
    variants = _diagnostic_variants(args, task, problems, cfg.loop.seed)
    scratch = Path(tempfile.mkdtemp(prefix="sleuth-eval-"))
    try:
        folder = model_folder(args.model, cfg, scratch)
        tokenizer = load_tokenizer(str(folder))
        print(f"evaluating {args.model} on {len(problems)} problems of {cfg.task.name}, k={k}", file=sys.stderr)
        engine = make_engine(cfg.rollout, str(folder), resolve_dtype(cfg.model.dtype), cfg.loop.seed)
        episodes = False
        diagnostics: dict[str, Any] = {}
        try:
            rollout = find_rollout(cfg.task, task)
            if rollout is not None:  # an episode task: avg@k over k episodes per problem
                runner = EpisodeRunner(rollout, engine, tokenizer, cfg.task.episode, eval_sampling(cfg))
                result = evaluate_episodes(runner, problems, k, eval_sampling(cfg), seed=cfg.loop.seed)
                episodes = True
            else:
                with VerifierRunner.from_config(task, cfg.task) as verifier:
                    def run_eval(batch: list[Any]) -> Any:
                        return evaluate(engine, task, tokenizer, batch, k, eval_sampling(cfg), verifier,
                                        seed=cfg.loop.seed, structured=cfg.rollout.structured_output)

                    result = run_eval(problems)
                    diagnostics = {name: run_eval(batch) for name, batch in variants.items()}
        finally:
            engine.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = result.summary()
    tokens_per_problem = k * (result.mean_prompt_tokens + result.mean_completion_tokens)
    summary.update(
        model=args.model, task=cfg.task.name, tokens_per_problem=tokens_per_problem, episodes=episodes,
        price_per_million_tokens=cfg.eval.price_per_million_tokens,
        cost_per_problem=tokens_per_problem * cfg.eval.price_per_million_tokens / 1e6,
    )
    summary[f"avg@{k}"], summary[f"pass@{k}"], summary[f"maj@{k}"] = result.avg, result.pass_k, result.maj
    summary["diagnostics"] = _diagnostic_summaries(result, diagnostics)
    margin = None if episodes else constant_margin(task, problems, result.per_problem)
    summary["constant_margin"] = None if margin is None else {
        "answer": margin[0], "difference": margin[1], "difference_se": margin[2]}
    if result.warning:
        print(f"sleuth: warning: {result.warning}", file=sys.stderr)
    with fsio.atomic_file(out / "samples.jsonl") as f:
        for rec in result.records:
            f.write(json.dumps(json_safe(rec), allow_nan=False) + "\n")
    fsio.write_text(out / "summary.json", json.dumps(json_safe(summary), indent=1, allow_nan=False))
    _print_table(summary, k, out)
    _print_kinds_and_diagnostics(summary, k, margin)
    print(f"avg@{k}={result.avg:.4f} pass@{k}={result.pass_k:.4f} maj@{k}={result.maj:.4f}")
    return 0


def _blame_flags(text: str, flags: dict[str, tuple[str, Any]], model: str, overrides: list[str]) -> str:
    """A config error's text naming where the bad value came from: the flag that set it, else a
    key=value override, else the run directory's config.yaml."""
    for key, (flag, value) in flags.items():
        if value is not None:
            text = text.replace(f"config key '{key}'", f"{flag} ({key})")
    given = {o.partition("=")[0].strip() for o in overrides}
    if is_run_dir(Path(model)):
        text = re.sub(r"config key '([^']+)'", lambda m: m.group(0) if m.group(1) in given
                      else f"{Path(model) / 'config.yaml'}: config key '{m.group(1)}'", text)
    return text


EVAL_FILES = ("samples.jsonl", "summary.json")


def check_eval_out(out: Path, given: bool) -> None:
    """An evaluation writes into a new folder or an empty one, never over an earlier evaluation's
    files or into a run directory (whose samples.jsonl is the run's own), as `train --out` refuses."""
    from sleuth.cli.train import RUN_MARKERS

    flag = f"--out {out}" if given else f"the output folder {out} (the default; choose one with --out)"
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"{flag} is a file, not a folder")
    held = [m for m in (*RUN_MARKERS, "config.yaml") if (out / m).exists()]
    if held or is_run_dir(out):
        raise UserError(f"{flag} is a run directory (it holds {held[0] if held else 'a run'}); an evaluation "
                        "writes into a folder of its own: choose another --out")
    earlier = [f for f in EVAL_FILES if (out / f).exists()]
    if earlier:
        raise UserError(f"{flag} already holds an evaluation ({earlier[0]}); choose another --out or remove it")


DIAGNOSTIC_TITLES = {"ablate_clues": "clues removed", "permute_options": "options permuted"}


def _diagnostic_variants(args: argparse.Namespace, task: Any, problems: list[Any], seed: int) -> dict[str, list[Any]]:
    """The changed copies of the held-out problems each requested diagnostic evaluates."""
    wanted = [name for name, on in (("ablate_clues", args.ablate_clues), ("permute_options", args.permute_options)) if on]
    make = task.diagnostic_problems if task.implements("diagnostic_problems") else None
    if wanted and make is None:
        flag = "--" + wanted[0].replace("_", "-")
        raise UserError(f"{flag} needs a task with clues and listed choices (temporal_clue), not {task.name}")
    return {name: make(name, problems, seed) for name in wanted} if make else {}


def _print_kinds_and_diagnostics(summary: dict[str, Any], k: int, margin: tuple[str, float, float] | None) -> None:
    from sleuth.eval.evaluate import constant_margin_line, kind_lines

    for line in kind_lines(summary.get("per_kind") or {}):
        print(line)
    if (line := constant_margin_line(margin)) is not None:
        print(line)
    for name, d in summary["diagnostics"].items():
        print(f"{DIAGNOSTIC_TITLES[name]}: avg@{k} {d['avg']:.4f} ± {d['avg_se']:.4f}, paired difference "
              f"{d['difference']:+.4f} ± {d['difference_se']:.4f} ({d['difference_in_se']:+.1f} SE)")


def _diagnostic_summaries(base: Any, diagnostics: dict[str, Any]) -> dict[str, dict[str, float]]:
    from sleuth.eval.evaluate import paired_difference

    out = {}
    for name, result in diagnostics.items():
        diff, se = paired_difference(base, result)
        out[name] = {"avg": result.avg, "avg_se": result.avg_se, "difference": diff, "difference_se": se,
                     "difference_in_se": diff / se if se > 0 else 0.0, "constant": result.constant,
                     "mean_prompt_tokens": result.mean_prompt_tokens, "per_kind": result.per_kind,
                     "per_problem": result.per_problem}
    return out


def _default_out(model: str, task: str, k: int) -> Path:
    path = Path(model)
    if is_run_dir(path):
        return path / f"eval-{task_slug(task)}-k{k}"
    return Path("evals") / f"{_slug(path.name or model)}-{task_slug(task)}-k{k}"


def task_slug(task: str) -> str:
    """A safe, readable folder-name part for a task: "temporal_clue", or for a user task
    "path/to/toy_task.py:problems" / "examples.toy_task:problems" -> "toy_task-problems"; an environment
    "openenv:http://127.0.0.1:8000" -> "openenv_http-127.0.0.1_8000"."""
    from sleuth.tasks.registry import environment_prefix

    name = task.strip()
    if environment_prefix(name) is not None:  # "verifiers:gsm8k", "openenv:http://host:8000" as a whole
        name = name.replace("://", "-")
    elif ":" in name:
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
        *([("held-out difficulty", s["difficulty"])] if s.get("difficulty") is not None else []),
        *([("first listed choice", f"{s['first_choice']:.4f} of answers")] if s.get("first_choice") is not None
          else []),
        ("chance level", chance),
        *([("best constant answer", f"{s['constant']:.4f}")] if s.get("constant") is not None else []),
        ("mean completion tokens", f"{s['mean_completion_tokens']:.1f}"),
        *([("evaluation time", f"{s['time_s']:.1f} s")] if s.get("time_s") else []),
        ("tokens per problem", f"{s['tokens_per_problem']:.0f}"),
        *([("episode failures", f"{s['episode_errors']} errors, {s['episode_timeouts']} timeouts of "
                                f"{s['problems'] * k} episodes")] if s.get("episodes") else
          [("verifier errors", f"{s['verifier_errors']} of {s['problems'] * k} samples")]),
        ("cost per problem", f"${s['cost_per_problem']:.6f} at ${s['price_per_million_tokens']:g}/M tokens"),
        ("samples", str(out / "samples.jsonl")),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
