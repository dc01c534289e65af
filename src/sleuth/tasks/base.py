"""The task interface: where problems come from and how a completion is verified."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, ClassVar

from sleuth.records import AnswerPart, Problem


class Task(ABC):
    """A source of problems plus a verifier.

    `train_problem(i)` must be a pure function of i (and the task's settings), so a resumed run
    that stored only its data position sees exactly the same problems.
    """

    name: str = "task"

    rollout: ClassVar[Callable[..., Awaitable[Any]] | None] = None
    """An episode task's `async def rollout(self, client, problem)`: the task's own agent code, run
    against the gateway, is the rollout (sleuth.gateway.runner); None for a single-turn task."""

    def implements(self, hook: str) -> bool:
        """Whether this task overrides the optional hook `hook` (e.g. "answer_parts"): the one way
        sleuth asks what a task supports (a hook left at its default declines)."""
        return getattr(type(self), hook) is not getattr(Task, hook)

    @abstractmethod
    def train_problem(self, index: int) -> Problem:
        """The index-th training problem (an endless, deterministic stream)."""

    @abstractmethod
    def eval_problems(self) -> list[Problem]:
        """The fixed held-out problems."""

    @abstractmethod
    def score(self, problem: Problem, completion: str) -> float:
        """Reward in [0, 1] for a completion's text. May raise; callers score a raising verifier 0."""

    def format_score(self, problem: Problem, completion: str) -> float | None:
        """How well a completion keeps the task's answer format, in [0, 1], whatever its
        correctness; None when the task has no format to check. Weighted by
        algorithm.format_reward and added to the training reward (never to evaluation). It runs in
        the trainer's process, so it must be cheap and must not raise."""
        return None

    def answer_parts(self, problem: Problem, completion: str) -> list[AnswerPart] | None:
        """The graded answers in a completion's text, each with its span and its own reward, for
        per-answer credit (algorithm.credit=answer); None when the task grades a completion as a
        whole. A question the completion leaves unanswered has no part (it counts as reward 0).
        Runs in the trainer's process: must be cheap and must not raise."""
        return None

    def stop_strings(self, problem: Problem) -> list[str]:
        """Strings that end a completion of `problem` (kept in its text), besides rollout.stop: where
        its answer is complete. Applied in training and evaluation alike; none by default."""
        return []

    def answer_pattern(self, problem: Problem) -> str | None:
        """A regular expression every well-formed answer to `problem` matches, for structured
        output (rollout.structured_output: the engine samples only completions that match it);
        None when the task has none. `sleuth.tasks.patterns.regex_literal` / `one_of` build literal parts."""
        return None

    def chance_reward(self, problem: Problem) -> float | None:
        """Expected reward of a uniformly random valid answer, when the task knows it."""
        return None

    def constant_rewards(self, problem: Problem) -> dict[str, float] | None:
        """The reward of each fixed answer that ignores the problem's content (e.g. `first`: the
        first listed choice on every line), when the task has such answers: a policy that settles
        on one of them can pass the chance level on a small held-out set without solving anything."""
        return None

    def answer_key(self, problem: Problem, completion: str) -> Hashable | None:
        """What two completions must share to count as the same answer in a majority vote (maj@k);
        by default the stripped text, None for an empty completion."""
        return completion.strip() or None

    def kind_scores(self, problem: Problem, completion: str) -> dict[str, tuple[float, float]] | None:
        """Per kind of question in `problem` (Temporal Clue: who / weapon / where / when / why /
        bonus): (the fraction of that kind's questions the completion answers right, the chance level
        of that kind). None when the task has no kinds. Evaluation only; must not raise."""
        return None

    def first_choice_share(self, problem: Problem, completion: str) -> float | None:
        """The fraction of the problem's questions the completion answers with the first listed
        choice, right or wrong (None: the task lists no choices). A policy that learned an answer
        position instead of the problem shows far above 1 / choices here. Must not raise."""
        return None

    @property
    def held_out_difficulty(self) -> str | None:
        """The level of the held-out problems where the task generates them at a difficulty
        (Temporal Clue: a rung name or a difficulty), printed with every held-out result; else None."""
        return None

    def diagnostic_problems(self, name: str, problems: list[Problem], seed: int = 0) -> list[Problem]:
        """The held-out problems changed for one of `sleuth eval`'s diagnostics: "ablate_clues" (the
        clues removed: a policy that reads them must drop) or "permute_options" (the listed choices
        moved: a policy that reasons must not). Only tasks with clues and listed choices have them
        (Task.implements("diagnostic_problems"))."""
        raise NotImplementedError(f"task {self.name} has no diagnostic problems")
