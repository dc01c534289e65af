"""One iteration's training batch: draw problems, generate, score, shape rewards, advantages, filter.

    sampler = Sampler(cfg, tokenizer, engine, verifier, task_for_level, progress)
    batch = sampler.collect(iteration, position, level, version)
    batch.groups        # groups with advantages, ready to pack and train
    batch.positions     # the data position of each of them (problem index in the training stream)
    batch.end           # the data position after this batch's draws: where the next batch starts

Problems are drawn by data position, a pure function of the index, so a batch is fully described
by where its draws started and ended. With DAPO dynamic sampling a batch takes up to
max_sampling_rounds rounds; each round draws exactly as many new problems as groups are still
missing, so no problem is drawn and then thrown away unseen, and the position stays exact for resume.

Reward shaping happens here, after the verifier and before advantages: the soft over-length penalty
(DAPO) is added to the reward and kept as its own term in `reward_info["overlong_penalty"]`, and so
is the weighted format reward (`reward_info["format_reward"]`, from the task's format_score);
rollout reward metrics are the verifier's rewards (before shaping) so runs stay comparable.
With mask_truncated, completions cut at max_tokens are removed from their group after the group's
advantages are computed: they count in the baseline but carry no loss.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sleuth.config import Config
from sleuth.eval.stats import mean_se
from sleuth.gateway.trajectories import EpisodeOutcome
from sleuth.records import Completion, Group, Problem, SamplingParams
from sleuth.rewards.advantages import ZERO_TOL, compute_advantages
from sleuth.rewards.credit import (
    assign_answer_credit,
    check_credit,
    has_signal,
    locates_answers,
    mask_to_answers,
)
from sleuth.rewards.verifier import VerifierRunner, score_groups
from sleuth.rollout.base import GenerationRequest, GenerationResult, RolloutEngine, to_groups
from sleuth.rollout.constraints import TokenMasks, attach_token_masks, constrained
from sleuth.run.metrics import prefixed
from sleuth.run.progress import Progress
from sleuth.system.models import encode_chat
from sleuth.system.seeds import derive_seed
from sleuth.tasks.base import Task

STREAM_ITERATION = 0
"""loop.streaming seeds a problem's requests as (seed, 0, data position): iterations count from 1."""


def request_seed(seed: int, iteration: int, index: int) -> int:
    """The sampling seed of request `index` of `iteration` (the same on a resumed run)."""
    return derive_seed("request", seed, iteration, index)


@dataclass
class Batch:
    """The training batch of one iteration and where its draws lie in the training stream."""

    iteration: int
    start: int
    """Data position of the first problem drawn for this batch."""
    end: int
    """Data position after the last draw: where the next batch starts."""
    version: int
    """Policy version (optimizer steps taken) of the weights that generated it."""
    groups: list[Group] = field(default_factory=list)
    """Groups with advantages that go into the update."""
    positions: list[int] = field(default_factory=list)
    """The data position of each group in `groups`."""
    reward_mean: float = 0.0
    """Mean verifier reward over every completion generated for the batch (the curriculum's signal)."""
    metrics: dict[str, Any] = field(default_factory=dict)


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft over-length penalty: 0 up to max_tokens - buffer, then linear down to -penalty."""
    if buffer <= 0 or length <= max_tokens - buffer:
        return 0.0
    return -penalty * min(length - (max_tokens - buffer), buffer) / buffer


def check_format_reward(cfg: Config, task: Task) -> str | None:
    """A start-up note when algorithm.format_reward is set for a task without a format score: the
    term is then 0 for it. The embedded default sets it for Temporal Clue, and a run that only
    changes task.name should still start, saying what it skips."""
    if cfg.algorithm.format_reward and not task.implements("format_score"):
        return (f"algorithm.format_reward={cfg.algorithm.format_reward:g}: task {cfg.task.name!r} has no format "
                "score (Task.format_score), so no format term is added; set algorithm.format_reward=0 to say so")
    return None


def print_shaping_notes(cfg: Config, task: Task) -> None:
    """Start-up (and --dry-run): one `sleuth: note:` line for each reward-shaping setting the task
    cannot use (check_format_reward, credit.check_credit); check_credit's errors propagate."""
    from sleuth.tasks.temporal_clue.reasoning import room_note

    for note in (check_format_reward(cfg, task), check_credit(cfg, task), room_note(cfg)):
        if note:
            print(f"sleuth: note: {note}", file=sys.stderr)


def mask_truncated(group: Group) -> Group:
    """The group without its completions cut at max_tokens (advantages already computed with them)."""
    assert group.advantages is not None
    keep = [i for i, c in enumerate(group.completions) if c.finish_reason != "length"]
    return replace(group, completions=[group.completions[i] for i in keep],
                   advantages=[group.advantages[i] for i in keep])


class Sampler:
    """Builds training batches from the task stream with one rollout engine and verifier."""

    def __init__(self, cfg: Config, tokenizer: Any, engine: RolloutEngine, verifier: VerifierRunner,
                 task_for_level: Callable[[int], Task], progress: Progress, episodes: Any = None) -> None:
        self.cfg = cfg
        self.episodes = episodes
        """Episode tasks: the EpisodeRunner whose agent code produces scored groups; None otherwise."""
        self.tokenizer = tokenizer
        self.engine = engine
        self.verifier = verifier
        self.task_for_level = task_for_level
        self.progress = progress
        r = cfg.rollout
        self.sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens,
                                       stop=tuple(r.stop))
        self.masks = TokenMasks(tokenizer) if r.structured_output and cfg.algorithm.constrained_logprobs else None
        """Structured output: replays each completion through its grammar for the trainer (structured.py)."""
        self.score_lock = threading.Lock()

    def one_group(self, position: int, level: int, version: int, times: dict[str, float],
                  metrics: dict[str, Any]) -> tuple[Group, bool, list[Any] | None]:
        """loop.streaming: the problem at `position` generated (or its episodes run), scored and given
        advantages on its own (seeded by its position), with whether it carries signal (kept by the
        batch's filters) and, for an episode task, its episodes' outcomes (episode_metrics)."""
        task = self.task_for_level(level)
        problem = task.train_problem(position)
        outcomes = None
        if self.episodes is not None:  # on the runner's shared session (GroupStream opens it)
            t = time.perf_counter()
            groups, per_problem = self.episodes.run([problem], self.cfg.rollout.samples_per_task,
                                                    request_seed(self.cfg.loop.seed, STREAM_ITERATION, position))
            times["rollout"] += time.perf_counter() - t
            (group,), outcomes = groups, per_problem[0]
        else:
            (group,) = self._generate_and_score(task, STREAM_ITERATION, position, [problem], times)
        group.version = version
        if not group.completions:  # every episode ended before its first model call: nothing to train
            return group, False, outcomes
        with self.score_lock:
            kept, _ = self._advantages(task, [group], [position], metrics)
        return (kept[0], True, outcomes) if kept else (group, False, outcomes)

    def collect(self, iteration: int, position: int, level: int, version: int) -> Batch:
        """Draw, generate and score rounds until the batch is full (one round without dynamic sampling)."""
        algo, want = self.cfg.algorithm, self.cfg.loop.tasks_per_iteration
        rounds = algo.max_sampling_rounds if algo.dynamic_sampling else 1
        batch = Batch(iteration, start=position, end=position, version=version)
        task = self.task_for_level(level)
        all_groups: list[Group] = []
        times = {"rollout": 0.0, "score": 0.0, "errors": 0.0, "timeouts": 0.0, "refused": 0.0}
        outcomes: list[Any] = []  # episode tasks: every episode's outcome, for episode_metrics
        n_rounds, drops = 0, 0
        for _ in range(rounds):
            need = want - len(batch.groups)
            if need <= 0:
                break
            n_rounds += 1
            positions = list(range(batch.end, batch.end + need))
            batch.end += need
            problems = [task.train_problem(i) for i in positions]
            if self.episodes is not None:
                groups = self._run_episodes(iteration, len(all_groups), problems, times, outcomes)
                # A problem whose episodes all ended before their first model call has nothing to
                # train on: its episodes scored 0 and count (episode_metrics); its group is dropped.
                positions = [p for p, g in zip(positions, groups, strict=True) if g.completions]
                drops += len(groups) - len(positions)
                groups = [g for g in groups if g.completions]
            else:
                groups = self._generate_and_score(task, iteration, len(all_groups), problems, times)
            all_groups.extend(groups)
            kept, kept_positions = self._advantages(task, groups, positions, batch.metrics)
            drops += len(groups) - len(kept)
            if not algo.dynamic_sampling:  # today's behaviour: whatever survived drop_zero_advantage
                batch.groups, batch.positions = kept, kept_positions
                break
            batch.groups.extend(kept)
            batch.positions.extend(kept_positions)
        batch.reward_mean = self._reward_metrics(all_groups, times, batch.metrics)
        if self.episodes is not None:
            batch.metrics.update(episode_metrics(outcomes, all_groups))
            batch.reward_mean = batch.metrics["rollout/reward_mean"]
            batch.metrics["rollout/tokens_per_s"] = batch.metrics["rollout/tokens"] / max(times["rollout"], 1e-9)
        batch.metrics.update({
            "rollout/sampling_rounds": float(n_rounds), "rollout/sampling_draws": float(batch.end - batch.start),
            "rollout/sampling_drops": float(drops), "train/groups": float(len(all_groups)),
            "train/groups_dropped": float(drops), "rollout/policy_version": float(version),
            "rollout/difficulty": float(level),
        })
        return batch

    # ------------------------------------------------------------------ the steps of a round

    def _generate_and_score(self, task: Task, iteration: int, first_index: int, problems: list[Problem],
                            times: dict[str, float]) -> list[Group]:
        seed = self.cfg.loop.seed
        t = time.perf_counter()
        prompts = [encode_chat(self.tokenizer, p.messages) for p in problems]
        r = self.cfg.rollout
        # Guided samples for the problems with an answer pattern (a user task's may lack one).
        n_guided = [r.guided_samples if r.guided_samples and task.answer_pattern(p) else 0 for p in problems]
        jobs = list(enumerate(zip(problems, prompts, n_guided, strict=True), start=first_index))
        requests = [self._request(task, p, ids, r.samples_per_task - g, f"{iteration}-{j}",
                                  request_seed(seed, iteration, j), r.structured_output)
                    for j, (p, ids, g) in jobs]
        # The guided requests after the free ones: each of their prompts is a vLLM prefix-cache hit.
        guided = [self._request(task, p, ids, g, f"{iteration}-{j}-guided",
                                derive_seed("guided", seed, iteration, j), True)
                  for j, (p, ids, g) in jobs if g]
        results = generate(self.engine, requests + guided, self.progress)
        times["rollout"] += time.perf_counter() - t
        with self.score_lock:  # loop.streaming generates groups on several threads, scores one at a time
            return self._score(task, iteration, problems, prompts, n_guided, requests, results, times)

    def _score(self, task: Task, iteration: int, problems: list[Problem], prompts: list[list[int]],
               n_guided: list[int], requests: list[GenerationRequest], results: list[GenerationResult],
               times: dict[str, float]) -> list[Group]:
        t = time.perf_counter()
        groups = to_groups(problems, prompts, results[:len(requests)])
        if len(results) > len(requests):  # the guided samples
            with_pattern = [i for i, g in enumerate(n_guided) if g]
            add_guided([groups[i] for i in with_pattern],
                       to_groups([problems[i] for i in with_pattern], [prompts[i] for i in with_pattern],
                                 results[len(requests):]))
        if self.masks is not None:
            times["refused"] += attach_token_masks(self.masks, groups, [r.sampling.regex for r in requests])
        stats = score_groups(self.verifier, groups)
        if warning := stats.all_failed_warning(f"iteration {iteration}"):
            print(f"sleuth: warning: {warning}", file=sys.stderr)
        times["score"] += time.perf_counter() - t
        times["errors"] += stats.verifier_errors
        times["timeouts"] += stats.verifier_timeouts
        return groups

    def _request(self, task: Task, problem: Problem, ids: list[int], n: int, request_id: str, seed: int,
                 structured: bool) -> GenerationRequest:
        """n samples of one prompt with its own seed, under the task's answer pattern when structured."""
        return GenerationRequest(ids, n=n, request_id=request_id,
                                 sampling=constrained(replace(self.sampling, seed=seed), task, problem, structured))

    def _run_episodes(self, iteration: int, first_index: int, problems: list[Problem], times: dict[str, float],
                      outcomes: list[Any]) -> list[Group]:
        """samples_per_task episodes per problem (already scored): one group per problem."""
        bar = self.progress.bar("episodes", total=len(problems))
        t = time.perf_counter()
        try:
            groups, round_outcomes = self.episodes.run(
                problems, self.cfg.rollout.samples_per_task, request_seed(self.cfg.loop.seed, iteration, first_index),
                on_group=lambda: self.progress.advance(bar))
        finally:
            self.progress.remove(bar)
        times["rollout"] += time.perf_counter() - t
        outcomes.extend(round_outcomes)
        return groups

    def _advantages(self, task: Task, groups: list[Group], positions: list[int],
                    metrics: dict[str, Any]) -> tuple[list[Group], list[int]]:
        """Shape rewards, compute advantages, drop zero-advantage groups, mask truncated completions."""
        algo, max_tokens = self.cfg.algorithm, self.cfg.rollout.max_tokens
        verifier_rewards = [[c.reward for c in g.completions] for g in groups]
        for g in groups:
            for c in g.completions:
                p = overlong_penalty(len(c.completion_ids), max_tokens, algo.overlong_buffer, algo.overlong_penalty)
                c.reward_info["overlong_penalty"] = p
                c.reward += p
                if algo.format_reward:
                    f = algo.format_reward * (task.format_score(g.problem, c.text) or 0.0)
                    c.reward_info["format_reward"] = f
                    c.reward += f
        with_adv, _ = compute_advantages(groups, algo.advantage, drop_zero=False)
        if algo.credit == "answer" and locates_answers(task):
            metrics.update(assign_answer_credit(with_adv, task, algo.advantage, self.tokenizer,
                                                algo.format_reward))
        if algo.loss_on == "answers":
            metrics.update(mask_to_answers(with_adv, task, self.tokenizer))
        for g, rewards in zip(groups, verifier_rewards, strict=True):  # keep the verifier's reward visible
            for c, r in zip(g.completions, rewards, strict=True):
                c.reward_info["verifier_reward"] = r
        drop = algo.drop_zero_advantage or algo.dynamic_sampling
        kept = [(g, p) for g, p in zip(with_adv, positions, strict=True) if not (drop and not has_signal(g, ZERO_TOL))]
        if algo.mask_truncated:
            kept = [(mask_truncated(g), p) for g, p in kept]
            kept = [(g, p) for g, p in kept if g.completions]
        metrics["train/advantage_abs_mean"] = _abs_mean([a for g, _ in kept for a in g.advantages or []])
        return [g for g, _ in kept], [p for _, p in kept]

    def _reward_metrics(self, groups: list[Group], times: dict[str, float], metrics: dict[str, Any]) -> float:
        """Rollout metrics of the policy's own (free) samples; guided samples count in the token
        totals and in rollout/guided_reward_mean only."""
        everything = [c for g in groups for c in g.completions]
        completions = [c for c in everything if not c.guided]
        rewards = [verifier_reward(c) for c in completions]
        lengths = [len(c.completion_ids) for c in everything]
        n = max(len(completions), 1)
        mean, se = mean_se(rewards)
        metrics.update(prefixed("rollout", dict(
            reward_mean=mean, reward_se=se, reward_max=max(rewards, default=0.0),
            verifier_errors=times["errors"], verifier_timeouts=times["timeouts"],
            completion_tokens_mean=sum(len(c.completion_ids) for c in completions) / n, tokens=sum(lengths),
            truncated_frac=sum(c.finish_reason == "length" for c in completions) / n,
            tokens_per_s=sum(lengths) / max(times["rollout"], 1e-9),
            overlong_penalty=sum(c.reward_info.get("overlong_penalty", 0.0) for c in completions) / n,
            format_reward=sum(c.reward_info.get("format_reward", 0.0) for c in completions) / n,
        )))
        if self.cfg.rollout.guided_samples:  # 0 for a batch without a guided sample
            metrics["rollout/guided_reward_mean"] = mean_se([verifier_reward(c) for c in everything if c.guided])[0]
        metrics.update({"time/rollout_s": times["rollout"], "time/score_s": times["score"]})
        if self.masks is not None:
            metrics["rollout/constraint_refused"] = times["refused"]
        return mean


def verifier_reward(c: Completion) -> float:
    """The verifier's reward of a completion, before reward shaping."""
    return c.reward_info.get("verifier_reward", c.reward)


def add_guided(groups: list[Group], guided: list[Group]) -> None:
    """Append each guided group's completions, marked guided, to the free group of its problem."""
    for g, extra in zip(groups, guided, strict=True):
        g.completions.extend(replace(c, guided=True) for c in extra.completions)


def _abs_mean(values: list[float]) -> float:
    return sum(abs(v) for v in values) / len(values) if values else 0.0


def generate(engine: RolloutEngine, requests: list[GenerationRequest],
             progress: Progress) -> list[GenerationResult]:
    """All results in request order, advancing a rollout bar as each group finishes."""
    bar = progress.bar("rollouts", total=len(requests))
    order = {r.request_id: i for i, r in enumerate(requests)}

    async def collect() -> list[GenerationResult]:
        out: list[GenerationResult | None] = [None] * len(requests)
        async for result in engine.stream(requests):
            out[order[result.request.request_id]] = result
            progress.advance(bar)
        return [r for r in out if r is not None]

    try:
        return asyncio.run(collect())
    finally:
        progress.remove(bar)


def episode_metrics(outcomes: Sequence[Sequence[EpisodeOutcome]], groups: Sequence[Group]) -> dict[str, float]:
    """rollout/* over episodes (not sequences), failures counted; the user's metrics averaged as
    episode/*, except "reward/<name>" (an environment's named reward components): rollout/reward/<name>."""
    flat = [o for per in outcomes for o in per]
    n = max(len(flat), 1)
    seqs = [c for g in groups for c in g.completions]
    sampled = [sum(c.loss_mask or [1] * len(c.completion_ids)) for c in seqs]
    rewards = [o.reward for o in flat]
    out = prefixed("rollout", {
        "reward_mean": mean_se(rewards)[0], "reward_se": mean_se(rewards)[1],
        "reward_max": max(rewards, default=0.0),
        "episodes": float(len(flat)),
        "episode_errors": float(sum(o.status == "error" for o in flat)),
        "episode_timeouts": float(sum(o.status == "timeout" for o in flat)),
        "episode_calls_mean": sum(o.episode.calls for o in flat) / n,
        "sequences_per_episode": len(seqs) / n,
        "template_mismatches": float(sum(o.episode.counts["template_mismatch"] for o in flat)),
        "bad_tool_calls": float(sum(o.episode.counts["bad_tool_calls"] for o in flat)),
        "completion_tokens_mean": sum(sampled) / max(len(seqs), 1),
        "tokens": float(sum(sampled)),
        "truncated_frac": sum(c.finish_reason == "length" for c in seqs) / max(len(seqs), 1),
    })
    keys = sorted({k for o in flat for k in o.metrics})
    for k in keys:
        values = [o.metrics[k] for o in flat if k in o.metrics]
        out[f"rollout/{k}" if k.startswith("reward/") else f"episode/{k}"] = sum(values) / len(values)
    return out
