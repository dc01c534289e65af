"""Per-answer credit: each graded answer's tokens take the advantage of that answer's own reward.

    groups = assign_answer_credit(groups, task, "grpo", tokenizer)   # algorithm.credit=answer

A Temporal Clue sheet answers 5-8 questions, and the verifier's reward is the fraction right. With
one advantage per completion (GRPO), the tokens that picked the right room on line C are pushed by
how the other lines went too: six lines of noise for one line of signal. Here each answer is its
own small group: question q's rewards across the group's completions (0 where a completion left q
unanswered) go through the configured estimator, and the tokens of completion i's line q take
advantage_q(i). Tokens outside every answer (a preamble, newlines, the EOS token) keep the
completion's own advantage, so reward shaping (over-length penalty, format reward) still reaches
them. A completion that stops before its last questions lost them by stopping: its ending (the
tokens after its last answer, EOS included) also takes, added to its own, the advantage of each
question whose key sorts after every key it answered. Without that, a question answered wrong is
pushed down while the same question left out is pushed nowhere, and GRPO drifts toward leaving it
out: 20 RL iterations of the main job stopped writing question E (docs/log.md, 2026-12-07). A
question skipped in the middle keeps no credit (the next line's label is where that choice was
made, and it belongs to that line); a completion with no answer at all keeps its own advantage,
which already says so. With structured output (sleuth.rollout.constraints) every token but the
answers' is forced anyway.
A task may return several parts with one key (Temporal Clue's deduce form with
task.temporal_clue.deduction_credit: the deduction line and the sheet line of a question): they all
take that key's advantage, and the first part's reward is the key's.

With algorithm.format_reward (weight w) an answer's own reward is its correctness plus w times its
own format score (AnswerPart.format_score; Temporal Clue: a listed choice or not), the per-answer
share of the sequence-level format reward. Without it the format term would reach only the tokens
between the answers, and a suspect named on a suspect line would get no more credit than a room
named there: the small model's collapse onto a room name on every line (docs/benchmarks.md).

With algorithm.loss_on=answers (structured output only) the tokens outside the answers' values,
forced by the constraint, carry no loss at all (mask_to_answers).

Token spans come from the text: the end of each token's decoded prefix locates it; a token that
overlaps two answers, or an answer and the text between, keeps the completion's advantage.
"""

from __future__ import annotations

from typing import Any

from sleuth.config import Config
from sleuth.errors import ConfigError
from sleuth.records import AnswerPart, Group
from sleuth.rewards.advantages import get_advantage
from sleuth.tasks.base import Task


def locates_answers(task: Task) -> bool:
    """Whether the task grades answers one by one (implements Task.answer_parts)."""
    return task.implements("answer_parts")


def check_credit(cfg: Config, task: Task) -> str | None:
    """algorithm.credit=answer for a task that grades a completion as a whole: a start-up note (its
    completions keep sequence credit; the embedded default sets it for Temporal Clue, and a run that
    only changes task.name should still start). algorithm.loss_on=answers needs a task that locates
    its answers and the constraint that forces the other tokens: a one-line error at start-up."""
    note = None
    if cfg.algorithm.credit == "answer" and not locates_answers(task):
        note = (f"algorithm.credit=answer: task {cfg.task.name!r} grades a completion as a whole (no "
                "Task.answer_parts), so its completions keep sequence credit; set algorithm.credit=sequence to say so")
    if cfg.algorithm.loss_on != "answers":
        return note
    if not task.implements("answer_parts"):
        raise ConfigError(f"algorithm.loss_on=answers: task {cfg.task.name!r} does not locate its answers "
                          "(no Task.answer_parts); set algorithm.loss_on=all")
    if not cfg.rollout.structured_output:
        raise ConfigError("algorithm.loss_on=answers needs rollout.structured_output=true: without the "
                          "constraint every token is the model's own choice and must carry loss")
    return note


def token_char_ends(tokenizer: Any, ids: list[int]) -> list[int]:
    """The end, in the decoded text, of each token's prefix (special tokens decode to nothing)."""
    return [len(tokenizer.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]


def token_parts(parts: list[AnswerPart], ends: list[int]) -> list[int]:
    """For each token, the index of the answer part whose span holds all of its characters, or -1.

    A token with no characters of its own (a special token) belongs to no part."""
    out, j, begin = [], 0, 0
    for end in ends:
        while j < len(parts) and parts[j].end <= begin:
            j += 1
        inside = j < len(parts) and end > begin and parts[j].start <= begin and end <= parts[j].end
        out.append(j if inside else -1)
        begin = end
    return out


def assign_answer_credit(groups: list[Group], task: Task, estimator: str, tokenizer: Any,
                         format_weight: float = 0.0) -> dict[str, float]:
    """Fill `Completion.token_advantages` of every completion of the groups (advantages already
    computed); returns metrics: the share of completion tokens that took an answer's advantage.
    `format_weight` (algorithm.format_reward) adds each answer's own weighted format score to its
    reward."""
    fn = get_advantage(estimator)
    credited = total = stopped_early = answering = 0
    for group in groups:
        assert group.advantages is not None, "compute_advantages first"
        if group.episode_index is not None:  # episodes: sequences of turns, graded as a whole
            continue
        parts = [sorted(task.answer_parts(group.problem, c.text) or [], key=lambda p: p.start)
                 for c in group.completions]
        keys = sorted({p.key for ps in parts for p in ps})
        per_key = {}
        for key in keys:
            rewards = [next((_part_reward(p, format_weight) for p in ps if p.key == key), 0.0) for ps in parts]
            per_key[key] = [float(a) for a in fn(rewards)]
        for i, (c, ps) in enumerate(zip(group.completions, parts, strict=True)):
            if not ps:  # nothing answered: every token keeps the completion's advantage
                c.token_advantages = [group.advantages[i]] * len(c.completion_ids)
                total += len(c.completion_ids)
                continue
            ends = token_char_ends(tokenizer, c.completion_ids)
            owner = token_parts(ps, ends)
            c.token_advantages = [group.advantages[i] if j < 0 else per_key[ps[j].key][i] for j in owner]
            stopped_early += _credit_the_ending(c.token_advantages, ends, ps, keys, [per_key[k][i] for k in keys])
            answering += 1
            credited += sum(j >= 0 for j in owner)
            total += len(owner)
    return {"train/answer_credit_frac": credited / total if total else 0.0,
            "train/stopped_early_frac": stopped_early / answering if answering else 0.0}


def _credit_the_ending(advantages: list[float], ends: list[int], parts: list[AnswerPart],
                       keys: list[str], key_advantages: list[float]) -> bool:
    """Add to the tokens after the last answer (EOS included) the advantage of every key sorting
    after all answered keys: the questions this completion left out by stopping (module docstring).
    Returns whether it left any out."""
    answered = max(p.key for p in parts)
    skipped = [a for k, a in zip(keys, key_advantages, strict=True) if k > answered]
    if not skipped:
        return False
    last_end, lost = max(p.end for p in parts), sum(skipped)
    for t, begin in enumerate([0, *ends[:-1]]):
        if begin >= last_end:
            advantages[t] += lost
    return True


def _part_reward(part: AnswerPart, format_weight: float) -> float:
    return part.reward + format_weight * (part.format_score or 0.0)


def mask_to_answers(groups: list[Group], task: Task, tokenizer: Any) -> dict[str, float]:
    """Set each completion's loss_mask to the tokens of its answers' values (algorithm.loss_on=answers).

    Under structured output the labels (`C. `), newlines and EOS are forced by the constraint: the
    sampler had no choice there, so their gradient (taken over the whole vocabulary) is noise, and
    under token-mean aggregation they dilute the answers' share of the loss. A token counts if any
    of its characters lie in an answer's value (a leading-space token like ` Library` does). A
    completion with no answer found (cut short) keeps every token. Returns the share kept."""
    kept = total = 0
    for group in groups:
        if group.episode_index is not None:  # episodes carry their own loss masks
            continue
        for c in group.completions:
            spans = [(p.start if p.value_start is None else p.value_start, p.end)
                     for p in task.answer_parts(group.problem, c.text) or []]
            if not spans:
                kept += len(c.completion_ids)
                total += len(c.completion_ids)
                continue
            mask, begin = [], 0
            for end in token_char_ends(tokenizer, c.completion_ids):
                mask.append(int(end > begin and any(begin < e and end > s for s, e in spans)))
                begin = end
            c.loss_mask = mask if any(mask) else None
            kept += sum(mask) if any(mask) else len(mask)
            total += len(mask)
    return {"train/loss_token_frac": kept / total if total else 0.0}


def has_signal(group: Group, tol: float) -> bool:
    """Whether any token of the group carries a non-zero advantage (sequence or per-answer)."""
    if any(abs(a) >= tol for a in group.advantages or []):
        return True
    return any(abs(a) >= tol for c in group.completions for a in (c.token_advantages or []))

