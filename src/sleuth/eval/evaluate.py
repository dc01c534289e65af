"""Held-out evaluation: k samples per problem, then avg@k, pass@k and maj@k with standard errors.

    with VerifierRunner.from_config(task, cfg.task) as verifier:
        result = evaluate(engine, task, tokenizer, problems, 8, SamplingParams(...), verifier)
    result.avg, result.avg_se, result.pass_k, result.maj, result.chance

- avg@k: mean reward of the k samples, averaged over problems.
- pass@k: chance that at least one of k samples is fully correct (reward 1), with the unbiased
  estimator 1 - C(n-c, k) / C(n, k) over n >= k samples of which c are correct.
- maj@k: reward of the most frequent answer among the k samples (majority vote). Answers are
  compared by the task's `answer_key(problem, text)` when it has one, else by the stripped text.
- Standard errors are over problems: sample std (ddof 1) / sqrt(number of problems).
- chance: the mean over problems of the task's expected reward for uniformly random valid
  answers, when the task knows it.
- constant: the best mean reward of one fixed answer that ignores the problems (the first listed
  choice on every line, ...), when the task has such answers: on a small held-out set a policy
  that learned only that answer can end above chance.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from sleuth.config import Config
from sleuth.eval.stats import (
    chance_level,
    constant_level,
    first_choice_level,
    kind_table,
    majority_reward,
    mean_se,
    pass_at_k,
)
from sleuth.records import Problem, SamplingParams
from sleuth.rewards.verifier import VerifierRunner, score_groups
from sleuth.rollout.base import GenerationRequest, RolloutEngine, to_groups
from sleuth.rollout.constraints import constrained
from sleuth.system.models import encode_chat
from sleuth.system.seeds import derive_seed
from sleuth.tasks.base import Task

CORRECT = 1.0 - 1e-9
"""A sample counts as correct for pass@k when its reward reaches 1 (up to rounding)."""


@dataclass
class EvalResult:
    k: int
    problems: int
    avg: float
    avg_se: float
    pass_k: float
    pass_se: float
    maj: float
    maj_se: float
    mean_completion_tokens: float
    chance: float | None
    mean_prompt_tokens: float = 0.0
    constant: float | None = None
    """The best fixed answer's mean reward on these problems (eval/stats.constant_level)."""
    time_s: float = 0.0
    first_choice: float | None = None
    """The share of questions answered with the first listed choice, right or wrong (mean over
    problems of their samples' Task.first_choice_share), when the task lists choices."""
    difficulty: str | None = None
    """The held-out puzzles' level where the task generates them (Task.held_out_difficulty)."""
    per_kind: dict[str, dict[str, float]] = field(default_factory=dict)
    """Accuracy per kind of question (Task.kind_scores; Temporal Clue: who / weapon / where / when /
    why / bonus): mean over the problems asking that kind, its standard error over them, the kind's
    chance level and the number of problems. Empty for a task without kinds."""
    per_problem: list[float] = field(default_factory=list)
    """avg@k of each problem, in order (paired comparisons between two evaluations)."""
    records: list[dict[str, Any]] = field(default_factory=list, repr=False)
    verifier_errors: int = 0
    """Samples whose verifier failed (scored 0), timeouts included."""
    verifier_timeouts: int = 0
    episode_errors: int = 0
    """Episode tasks: episodes that raised or returned no valid reward (scored 0)."""
    episode_timeouts: int = 0
    """Episode tasks: episodes that ran past task.episode.timeout_s (scored 0)."""
    warning: str | None = None
    """Set when every verifier call (or every episode) failed: the evaluation measured nothing."""

    def summary(self) -> dict[str, Any]:
        """Everything but the per-sample records (what summary.json and metrics hold)."""
        out = asdict(self)
        out.pop("records")
        return out

    def line(self) -> str:
        k = self.k
        return f"avg@{k}={self.avg:.4f} pass@{k}={self.pass_k:.4f} maj@{k}={self.maj:.4f}"


def summarize(
    rewards: Sequence[Sequence[float]],
    keys: Sequence[Sequence[Hashable | None]],
    k: int,
    completion_tokens: Sequence[Sequence[int]] = (),
    chance: float | None = None,
) -> EvalResult:
    """The metrics from per-problem rewards and answer keys (n >= k samples per problem)."""
    avgs, passes, majs = [], [], []
    for r, key in zip(rewards, keys, strict=True):
        n = len(r)
        if n < k:
            raise ValueError(f"a problem has {n} samples, fewer than k={k}")
        avgs.append(sum(r) / n)
        passes.append(pass_at_k(n, sum(1 for x in r if x >= CORRECT), k))
        majs.append(majority_reward(r[:k], key[:k]))
    tokens = [t for per in completion_tokens for t in per]
    avg, avg_se = mean_se(avgs)
    pk, pk_se = mean_se(passes)
    mj, mj_se = mean_se(majs)
    return EvalResult(
        k=k, problems=len(avgs), avg=avg, avg_se=avg_se, pass_k=pk, pass_se=pk_se, maj=mj, maj_se=mj_se,
        mean_completion_tokens=sum(tokens) / len(tokens) if tokens else 0.0, chance=chance,
        per_problem=avgs,
    )


def kind_lines(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]] | None = None) -> list[str]:
    """The per-kind table as lines: kind, problems, chance, accuracy ± standard error (before and
    after when both are given)."""
    if not before:
        return []
    head = f"  {'question kind':<14}{'problems':>9}{'chance':>8}  " + ("before           after" if after else "accuracy")
    lines = [head]
    for kind, v in before.items():
        row = f"  {kind:<14}{int(v['problems']):>9}{v['chance']:>8.3f}  {v['mean']:.3f} ± {v['se']:.3f}"
        if after and kind in after:
            row += f"    {after[kind]['mean']:.3f} ± {after[kind]['se']:.3f}"
        lines.append(row)
    return lines


def constant_margin_line(margin: tuple[str, float, float] | None) -> str | None:
    """stats.constant_margin's (answer, difference, se) as the line `sleuth train` and `sleuth eval`
    print; None when the task has no constant answers."""
    if margin is None:
        return None
    name, diff, se = margin
    return (f"against the best constant answer ({name}): {diff:+.3f} ± {se:.3f} "
            f"({diff / se if se else 0.0:+.1f} SE, paired)")


def paired_difference(base: EvalResult, other: EvalResult) -> tuple[float, float]:
    """Mean per-problem difference other - base over the same problems, with its standard error."""
    return mean_se([b - a for a, b in zip(base.per_problem, other.per_problem, strict=True)])


def answer_key_fn(task: Task) -> Callable[[Problem, str], Hashable | None]:
    """The task's answer key for majority votes (Task.answer_key: by default the stripped text)."""
    return task.answer_key


def eval_sampling(cfg: Config) -> SamplingParams:
    """Sampling at evaluation: eval.temperature, eval.max_tokens (else rollout's), rollout's top_p/stop."""
    return SamplingParams(temperature=cfg.eval.temperature, top_p=cfg.rollout.top_p,
                          max_tokens=cfg.eval.max_tokens or cfg.rollout.max_tokens, stop=tuple(cfg.rollout.stop))


def evaluate(
    engine: RolloutEngine,
    task: Task,
    tokenizer: Any,
    problems: Sequence[Problem],
    k: int,
    sampling: SamplingParams,
    verifier: VerifierRunner,
    seed: int = 0,
    structured: bool = False,
) -> EvalResult:
    """Sample k completions per problem, score them, and summarize. Deterministic for a seed.

    Each request gets its own sampling seed (derived from seed and the problem position), so results do not depend
    on how the engine batches them; a verifier that fails scores 0 (see sleuth.rewards.verifier). structured: each
    completion constrained to the task's answer pattern (rollout.structured_output, sleuth.rollout.constraints).
    """
    start = time.perf_counter()
    prompts = [encode_chat(tokenizer, p.messages) for p in problems]
    requests = [
        GenerationRequest(ids, n=k, request_id=p.id,
                          sampling=constrained(replace(sampling, seed=derive_seed("eval", seed, i)), task, p, structured))
        for i, (p, ids) in enumerate(zip(problems, prompts, strict=True))
    ]
    groups = to_groups(problems, prompts, engine.generate_all(requests))
    stats = score_groups(verifier, groups)
    key_of = answer_key_fn(task)
    has_key = task.implements("answer_key")
    rewards, keys, tokens, records = [], [], [], []
    for g in groups:
        key = [key_of(g.problem, c.text) for c in g.completions]
        rewards.append(g.rewards)
        keys.append(key)
        tokens.append([len(c.completion_ids) for c in g.completions])
        for j, c in enumerate(g.completions):
            record = {
                "problem_id": g.problem.id, "sample": j, "reward": c.reward, "tokens": len(c.completion_ids),
                "finish_reason": c.finish_reason, "verifier_error": c.reward_info.get("verifier_error", 0.0),
                "text": c.text,
            }
            if has_key:  # the fallback key is the text itself: not worth writing twice
                record["answer_key"] = None if key[j] is None else str(key[j])
            records.append(record)
    out = summarize(rewards, keys, k, tokens, chance_level(task, problems))
    out.records = records
    out.constant = constant_level(task, problems)
    out.per_kind = kind_table(task, groups)
    out.first_choice = first_choice_level(task, groups)
    out.difficulty = task.held_out_difficulty
    out.verifier_errors, out.verifier_timeouts = stats.verifier_errors, stats.verifier_timeouts
    out.warning = stats.all_failed_warning("the evaluation")
    out.mean_prompt_tokens = sum(map(len, prompts)) / max(len(prompts), 1)
    out.time_s = time.perf_counter() - start
    return out


def evaluate_episodes(runner: Any, problems: Sequence[Problem], k: int, sampling: SamplingParams,
                      seed: int = 0) -> EvalResult:
    """Episode tasks: k episodes per problem (an EpisodeRunner), avg@k / pass@k over episode rewards;
    maj@k votes on each episode's last reply text. Episode (j, i) is seeded seed + 4096 j + i."""
    import asyncio

    start = time.perf_counter()

    async def run_all() -> list[list[Any]]:
        async with runner.session() as http:
            per = [asyncio.gather(*(runner.episode(p, seed + 4096 * j + i, sampling, http) for i in range(k)))
                   for j, p in enumerate(problems)]
            return [list(o) for o in await asyncio.gather(*per)]

    from sleuth.gateway.runner import run_loop

    outcomes = run_loop(run_all())
    rewards, keys, tokens, records = [], [], [], []
    for p, per in zip(problems, outcomes, strict=True):
        rewards.append([o.reward for o in per])
        texts = [o.episode.turns[-1].text.strip() if o.episode.turns else "" for o in per]
        keys.append([t or None for t in texts])
        tokens.append([o.episode.sampled_tokens for o in per])
        for j, (o, text) in enumerate(zip(per, texts, strict=True)):
            records.append({"problem_id": p.id, "sample": j, "reward": o.reward, "tokens": o.episode.sampled_tokens,
                            "calls": o.episode.calls, "status": o.status, "error": o.error, "text": text,
                            "metrics": o.metrics})
    out = summarize(rewards, keys, k, tokens)
    out.records = records
    flat = [o for per in outcomes for o in per]
    out.episode_errors = sum(o.status == "error" for o in flat)
    out.episode_timeouts = sum(o.status == "timeout" for o in flat)
    failed = [o for o in flat if o.status != "ok"]
    if failed and len(failed) == len(flat):
        out.warning = (f"every one of the {len(flat)} episodes failed (scored 0), so the evaluation measured "
                       f"nothing; first: {failed[0].status}: {failed[0].error}")
    out.time_s = time.perf_counter() - start
    return out

