"""The typed records every stage passes on.

tasks -> Problem; rollout -> Sample (token ids + logprobs); scoring fills Completion.reward;
advantages fill Group.advantages; packing and the trainer read Groups; weight sync hands the
rollout engine a LoraAdapter (or full weights).
Token ids are kept exactly as sampled: nothing downstream re-tokenizes text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from sleuth.errors import UserError

Message = dict[str, str]
"""A chat message: {"role": "system" | "user" | "assistant", "content": str}."""

FinishReason = Literal["stop", "length", "abort"]
"""Why a sample ended: a stop token/string, the max-token limit, or aborted (degenerate / timed out)."""


MAX_ABS_REWARD = 1e6
"""A reward outside [-1e6, 1e6] is an error (scored 0): group statistics square rewards, and a
value like 1e308 would overflow the advantages."""


@dataclass(frozen=True)
class Problem:
    """One task instance: what the model sees and what its verifier needs."""

    id: str
    messages: list[Message]
    """The prompt as chat messages; rendered with the tokenizer's chat template."""
    answer: Any
    """The reference the verifier checks against (a solution dict, an integer, ...)."""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    regex: str | None = None
    """Structured output: the completion must match this regular expression (the engine masks
    every token that would leave it, and ends the completion where it is complete); None: free text.
    Per request: the sampler and the evaluation set it from `Task.answer_pattern(problem)`."""


@dataclass
class Sample:
    """One sampled continuation, as an engine returns it."""

    token_ids: list[int]
    logprobs: list[float]
    """The engine's logprob of each sampled token (same length as token_ids)."""
    finish_reason: FinishReason
    text: str
    time_s: float = 0.0
    """Wall time from the request's start until this sample finished."""
    token_versions: list[int] | None = None
    """Policy version of the weights that sampled each token, from an engine that takes weight
    updates in flight (loop.streaming); None: one version for the whole sample."""


@dataclass(frozen=True)
class AnswerPart:
    """One graded answer inside a completion's text (per-answer credit, credit.py)."""

    key: str
    """Which answer it is (a question's letter): parts with the same key are compared across a group."""
    start: int
    end: int
    """Its characters in the completion text: text[start:end]."""
    reward: float
    """This answer's own reward (1.0 right, 0.0 wrong)."""
    value_start: int | None = None
    """Where the answer itself begins, after its label (`C. `); None: at start. The tokens of
    text[value_start:end] are the ones algorithm.loss_on=answers trains on."""
    format_score: float | None = None
    """This answer's own format score in [0, 1] (Temporal Clue: 1.0 when it names one of the
    question's listed choices, right or wrong); None: the task has none. With
    algorithm.format_reward it joins the answer's reward under per-answer credit (credit.py)."""


@dataclass
class Completion:
    """A sample attached to its prompt, with its reward once scored."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str
    reward: float = 0.0
    reward_info: dict[str, float] = field(default_factory=dict)
    """Named reward terms and flags (e.g. {"verifier_error": 1.0}), logged separately."""
    loss_mask: list[int] | None = None
    """Multi-turn episodes: same length as completion_ids; 1 for tokens the model sampled, 0 for
    tokens the environment or chat template inserted (tool results, user turns, template tokens
    between turns), which carry no loss and no gradient. With algorithm.loss_on=answers, 0 also
    marks tokens the structured-output constraint forced (credit.mask_to_answers). `logprobs` holds the engine logprob of
    sampled tokens and 0.0 for masked ones. None means every completion token was sampled.
    `prompt_ids` may differ between completions of one group (a call that does not extend the
    episode's previous call starts a new sequence with its own prompt); packing shares the longest
    common token prefixes of the full sequences (prompt_ids + completion_ids)."""
    token_bitmask: Any = None
    """Constrained decoding (rollout.structured_output with algorithm.constrained_logprobs): a
    [len(completion_ids), W] int32 torch tensor, bit j of word w set where token 32w + j was
    allowed at that step (xgrammar's layout); the trainer's logprobs are then the constrained
    policy's (train/logprobs.py). None: unconstrained."""
    guided: bool = False
    """Drawn under the task's answer pattern among free samples (rollout.guided_samples): the
    trainer gives its tokens no importance weight towards the constraint that drew it."""
    token_advantages: list[float] | None = None
    """Per-answer credit (algorithm.credit=answer): the advantage of each completion token (same
    length as completion_ids), each answer's tokens taking that answer's own; None: every token
    takes the group's advantage for the completion (Group.advantages)."""
    token_versions: list[int] | None = None
    """Sample.token_versions: the policy version behind each completion token when weights changed
    while it was sampled (loop.streaming); None: the group's version for every token."""


@dataclass
class Group:
    """n completions of one prompt: the unit of group-relative advantages and of prompt sharing.

    For episode tasks, `prompt_ids` is the episodes' first prompt; each completion carries its own
    full prompt (see Completion.prompt_ids)."""

    problem: Problem
    prompt_ids: list[int]
    completions: list[Completion]
    advantages: list[float] | None = None
    episode_rewards: list[float] | None = None
    """Episode tasks: one reward per episode of the group (advantages are computed over these)."""
    episode_index: list[int] | None = None
    """Episode tasks: the episode each completion (sequence) belongs to; it gets that episode's
    advantage. An episode may have several sequences, or none (no call: it counts in the rewards)."""
    version: int | None = None
    """loop.streaming: the policy version of the engine's weights when the group's generation began
    (its completions' token_versions say which tokens came later); None: the batch's version."""

    @property
    def rewards(self) -> list[float]:
        return [c.reward for c in self.completions]


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter as the trainer holds it, without writing it to disk.

    tensors: PEFT state-dict names (`...q_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r]),
    any prefix before the HF module name (e.g. `base_model.model.`) is stripped.
    """

    tensors: Mapping[str, Any]
    rank: int
    alpha: float
    target_modules: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def nbytes(self) -> int:
        """Bytes of the adapter's tensors (what an adapter-only weight sync moves)."""
        return sum(int(t.numel()) * int(t.element_size()) for t in self.tensors.values())

    def deltas(self) -> dict[str, Any]:
        """{HF weight name: scaling * B @ A} for every adapted module."""
        pairs: dict[str, dict[str, Any]] = {}
        for name, t in self.tensors.items():
            for kind in ("lora_A", "lora_B"):
                marker = f".{kind}."
                if marker in name:
                    module = name.split(marker)[0]
                    module = module.removeprefix("base_model.model.")
                    pairs.setdefault(module, {})[kind] = t
        out = {}
        for module, ab in pairs.items():
            if set(ab) != {"lora_A", "lora_B"}:
                raise UserError(f"LoRA adapter: module {module} lacks lora_A or lora_B")
            out[f"{module}.weight"] = self.scaling * (ab["lora_B"].float() @ ab["lora_A"].float())
        return out

    def peft_config(self, base_model: str) -> dict[str, Any]:
        modules = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in self.tensors})
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": self.rank, "lora_alpha": self.alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": list(self.target_modules) or modules,
        }
