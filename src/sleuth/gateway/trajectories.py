"""An episode's calls -> training sequences, and a problem's episodes -> one Group.

Every turn that no later call extended ends a chain of calls that extend each other: that chain is
one training sequence, its ids exactly as served (the root call's prompt, then every later reply
and every inserted template/tool/user token), with `loss_mask` 1 on the tokens the model sampled
and the engine's logprobs on them (0.0 elsewhere). A call that extended nothing started a chain of
its own. All sequences of an episode carry the episode's reward; advantages are computed over the
group's episodes (one reward each) and every sequence gets its episode's (Group.episode_rewards /
Group.episode_index, read by sleuth.rewards.advantages).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sleuth.gateway.history import Episode
from sleuth.records import Completion, Group, Problem


@dataclass
class EpisodeOutcome:
    """What running one episode gave: its reward, why it ended, its metrics, its recorded calls."""

    episode: Episode
    reward: float
    status: str = "ok"
    """ok, error (the episode function raised) or timeout (ran past task.episode.timeout_s)."""
    error: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


def sequences(episode: Episode, reward: float) -> list[Completion]:
    """One Completion per chain of calls (the turns nothing extended), in call order."""
    out = []
    for turn in episode.turns:
        if turn.extended:
            continue
        start = turn.prompt_len
        out.append(Completion(
            prompt_ids=turn.ids[:start], completion_ids=turn.ids[start:], logprobs=turn.logprobs[start:],
            finish_reason=turn.finish_reason,  # type: ignore[arg-type]
            text=turn.text, reward=reward, loss_mask=turn.mask[start:],
        ))
    return out


def episode_group(problem: Problem, outcomes: Sequence[EpisodeOutcome]) -> Group:
    """The group of one problem's episodes: every sequence of every episode, each tagged with its
    episode's index; episodes without any call still count in the group's rewards."""
    completions: list[Completion] = []
    index: list[int] = []
    for i, o in enumerate(outcomes):
        seqs = sequences(o.episode, o.reward)
        completions += seqs
        index += [i] * len(seqs)
    prompt = completions[0].prompt_ids if completions else []
    return Group(problem=problem, prompt_ids=prompt, completions=completions,
                 episode_rewards=[o.reward for o in outcomes], episode_index=index)
