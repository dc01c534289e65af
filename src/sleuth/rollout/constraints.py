"""Structured output: completions constrained to a task's answer pattern.

With `rollout.structured_output` every request carries `SamplingParams.regex`, the task's
`answer_pattern(problem)`; the engine masks each token that would leave the pattern and ends the
completion once the pattern is complete (vLLM's structured outputs; TRL ships the same lever as
its guided-decoding regex). A small model then spends its samples on *which* answer to give, not
on learning the answer's format (docs/benchmarks.md, "learning").

The policy that acted is the constrained one: at each step the model's distribution renormalized
over the tokens the grammar allowed, and vLLM's logprobs are that distribution's (its bitmask is
applied to the logits before they are computed). With algorithm.constrained_logprobs (the default)
TokenMasks replays each completion through the same grammar (xgrammar, vLLM's default backend) and
the trainer scores the same constrained distribution (Completion.token_bitmask, train/logprobs.py):
its logprobs match the engine's, a forced token (a label, a newline, the rest of a choice once its
first token fixes it) carries no gradient, and a negative advantage moves probability to the other
allowed choices rather than to text the grammar would never let through. Scoring the raw model
instead (false) weights every token by the mass the grammar allowed (the truncated IS weight is
then that mass: train/tis_weight_mean about 0.6 on SmolLM2) and pushes mass off forced tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from sleuth.errors import ConfigError
from sleuth.records import Problem, SamplingParams

if TYPE_CHECKING:
    from sleuth.config import Config
    from sleuth.tasks.base import Task

def check_structured_output(cfg: Config, task: Task, engine_kind: str) -> None:
    """rollout.structured_output needs a task with an answer pattern and the vLLM engine: a
    one-line error at start-up (and in --dry-run) instead of free text or a failure mid-run."""

    if not cfg.rollout.structured_output:
        return
    if not task.implements("answer_pattern"):
        raise ConfigError(f"rollout.structured_output: task {cfg.task.name!r} has no answer pattern "
                          "(Task.answer_pattern); set rollout.structured_output=false")
    if engine_kind != "vllm":
        raise ConfigError("rollout.structured_output needs rollout.engine=vllm (vLLM's structured outputs); "
                          f"the {engine_kind} engine samples free text only")


def guided_samples(cfg: Config, task: Task, engine_kind: str) -> tuple[int, str | None]:
    """How many of each group's samples a run draws guided (rollout.guided_samples), and a start-up
    note when it cannot draw the configured ones: the embedded default sets one for Temporal Clue on
    vLLM, and a run that changes the task or the engine should still start, saying what it skips.
    Guided samples that would leave no free one are a ConfigError."""
    from sleuth.tasks.user import find_rollout

    r = cfg.rollout
    if not r.guided_samples:
        return 0, None
    if r.structured_output:
        reason = "every sample is already constrained (rollout.structured_output)"
    elif find_rollout(cfg.task, task) is not None:
        reason = f"task {cfg.task.name!r} runs episodes, whose calls its rollout function makes"
    elif not task.implements("answer_pattern"):
        reason = f"task {cfg.task.name!r} has no answer pattern (Task.answer_pattern)"
    elif engine_kind != "vllm":
        reason = f"the {engine_kind} engine has no structured outputs (rollout.engine=vllm has)"
    else:
        if r.guided_samples >= r.samples_per_task:
            raise ConfigError(f"rollout.guided_samples={r.guided_samples} leaves no free sample in groups of "
                              f"rollout.samples_per_task={r.samples_per_task}; use fewer guided samples")
        return r.guided_samples, None
    return 0, (f"rollout.guided_samples={r.guided_samples}: {reason}, so every sample is drawn freely; "
               "set rollout.guided_samples=0 to say so")


def resolve_guided_samples(cfg: Config, task: Task, engine_kind: str) -> Config:
    """`cfg` with the guided samples the run will draw (guided_samples), printing its note if any:
    the config a run stores and samples with (start-up and --dry-run)."""
    n, note = guided_samples(cfg, task, engine_kind)
    if note:
        print(f"sleuth: note: {note}", file=sys.stderr)
    if n == cfg.rollout.guided_samples:
        return cfg
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"guided_samples": n})})


def constrained(sampling: SamplingParams, task: Task, problem: Problem, enabled: bool) -> SamplingParams:
    """`sampling` for one problem: the task's stop strings for it added, and the problem's answer
    pattern as its regex when structured output is on."""
    stops = [s for s in task.stop_strings(problem) if s not in sampling.stop]
    if stops:
        sampling = replace(sampling, stop=(*sampling.stop, *stops))
    if not enabled:
        return sampling
    pattern = task.answer_pattern(problem)
    if not pattern:
        raise ConfigError(f"rollout.structured_output: task {task.name!r} gave no answer pattern for "
                          f"problem {problem.id!r}")
    return replace(sampling, regex=pattern)


class TokenMasks:
    """The tokens a completion's grammar allowed at each of its steps, as the engine saw them.

        masks = TokenMasks(tokenizer)
        bitmask, refused = masks.bitmask(regex, completion_ids)   # [n, ceil(vocab/32)] int32

    Regexes compile once each (xgrammar's cache). A sampled token the grammar refuses (another
    backend, another tokenizer revision) ends the replay: that step and the ones after allow every
    token, as if unconstrained, and `refused` is 1 (rollout/constraint_refused)."""

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer)
        self._compiler = xgr.GrammarCompiler(self.info, cache_enabled=True)

    def bitmask(self, regex: str, ids: list[int]) -> tuple[torch.Tensor, int]:
        matcher = self._xgr.GrammarMatcher(self._compiler.compile_regex(regex))
        out = self._xgr.allocate_token_bitmask(len(ids), self.info.vocab_size)
        for k, token in enumerate(ids):
            matcher.fill_next_token_bitmask(out, k)
            if not matcher.accept_token(token):
                out[k:] = -1
                return out, 1
        return out, 0


def attach_token_masks(masks: TokenMasks, groups: Iterable[Any], regexes: Iterable[str | None]) -> int:
    """Set Completion.token_bitmask on every completion of each group constrained by its regex;
    returns how many completions had a token the grammar refused."""
    refused = 0
    for group, regex in zip(groups, regexes, strict=True):
        if not regex:
            continue
        for c in group.completions:
            c.token_bitmask, r = masks.bitmask(regex, c.completion_ids)
            refused += r
    return refused
