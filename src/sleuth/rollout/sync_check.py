"""Proof that a weight sync arrived: the engine's logprobs of a fixed probe match the trainer's.

    check = SyncCheck(policy, engine, tokenizer, tolerance=0.05)
    reference = check.reference()          # the trainer's side, with the weights about to be sent
    ... send them ...
    seconds = check.verify(reference, "weight sync 3 (adapter)")   # raises WeightSyncCheckError

A sync can "succeed" without delivering anything (an adapter the engine never applies, a worker
that kept its old weights): rollouts then sample the old policy and it passes for staleness. So after
every sync each engine replica (every Ray rollout worker) decodes a fixed probe prompt greedily, and
the logprobs it returns for its tokens are compared with the trainer's log-softmax at the same
steps, as of the weights that were sent. The comparison follows the engine's tokens while they agree
with the trainer's greedy ones and includes the first step where they differ (still the same prefix),
so a near tie never misaligns it. The mean absolute difference must stay within
rollout.sync_check_tolerance. One optimizer step may move the probe's logprobs by less than that: a
sync that never arrives is caught once the weights have drifted past the tolerance, not necessarily
at the first step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sleuth.errors import UserError
from sleuth.records import SamplingParams
from sleuth.rollout.base import GenerationRequest, RolloutEngine

PROBE_TEXT = "Weight check: the quick brown fox jumps over the lazy dog, then counts 1, 2, 3."
"""The probe prompt (the same on every run; no chat template, it only has to be fixed)."""
PROBE_TOKENS = 8
"""Greedy steps compared per replica."""


class WeightSyncCheckError(UserError):
    """The engine's weights after a sync do not reproduce the trainer's (the sync did not arrive).
    A UserError so the run stops with its one line (the CLI exits 2); checkpoints stay as saved."""


class ProbeSource(Protocol):
    """The trainer's side: train/policy.py's Policy."""

    def greedy_probe(self, prompt_ids: list[int], n: int) -> tuple[list[int], torch.Tensor]: ...


@dataclass(frozen=True)
class Reference:
    tokens: list[int]
    log_softmax: torch.Tensor
    """[PROBE_TOKENS, V]: the trainer's log-softmax at each greedy step."""
    seconds: float


def probe_gap(reference: Reference, tokens: list[int], logprobs: list[float]) -> float:
    """Mean |engine logprob - trainer logprob| over the engine's probe tokens, up to and including
    the first one that differs from the trainer's greedy token."""
    gaps = []
    for j, (t, lp) in enumerate(zip(tokens, logprobs)):
        if j >= len(reference.tokens) or t >= reference.log_softmax.shape[1]:
            break
        gaps.append(abs(lp - float(reference.log_softmax[j, t])))
        if t != reference.tokens[j]:
            break
    return sum(gaps) / len(gaps) if gaps else float("inf")


class SyncCheck:
    """Checks one engine (or every replica of a RolloutPool) against the trainer after a sync."""

    def __init__(self, policy: ProbeSource, engine: RolloutEngine, tokenizer: Any, tolerance: float) -> None:
        self.policy = policy
        self.engine = engine
        self.tolerance = tolerance
        self.prompt = list(tokenizer.encode(PROBE_TEXT, add_special_tokens=False))[:48]
        self.request = GenerationRequest(self.prompt, n=1, request_id="sync-check",
                                         sampling=SamplingParams(temperature=0.0, top_p=1.0,
                                                                 max_tokens=PROBE_TOKENS, seed=0))

    def reference(self) -> Reference:
        """The trainer's greedy probe with its current weights (call before they change)."""
        start = time.perf_counter()
        tokens, log_softmax = self.policy.greedy_probe(self.prompt, PROBE_TOKENS)
        return Reference(tokens, log_softmax, time.perf_counter() - start)

    def verify(self, reference: Reference, what: str) -> float:
        """Probe every replica; raise WeightSyncCheckError naming `what` when one is off. Returns the
        check's seconds (the reference's included)."""
        start = time.perf_counter()
        for i, result in enumerate(self.engine.probe_replicas(self.request)):
            sample = result.samples[0]
            gap = probe_gap(reference, list(sample.token_ids), list(sample.logprobs))
            if not gap <= self.tolerance:
                where = f" on rollout worker {i}" if len(getattr(self.engine, "workers", [])) > 1 else ""
                raise WeightSyncCheckError(
                    f"{what}: the engine's logprobs of the probe differ from the trainer's by {gap:.4f} on "
                    f"average{where} (rollout.sync_check_tolerance={self.tolerance:g}): the new weights did not "
                    "arrive in the engine")
        return reference.seconds + time.perf_counter() - start


AUTO_TOLERANCE = {"float32": 0.05, "bfloat16": 0.25, "float16": 0.25}
"""rollout.sync_check_tolerance=auto by model dtype (the mean absolute logprob difference allowed)."""


def make_sync_check(policy: Any, engine: RolloutEngine, tolerance: float | str | None,
                    dtype: str) -> SyncCheck | None:
    """rollout.sync_check_tolerance's check (auto: by `dtype`, the run's resolved model dtype), or
    None when it is off (None or 0). `policy`: the trainer in this process (Policy) or its FSDP2
    ranks (TrainerGroup: the probe runs on every rank, rank 0's is compared)."""
    if tolerance == "auto":
        tolerance = AUTO_TOLERANCE.get(dtype, AUTO_TOLERANCE["bfloat16"])
    if not tolerance:
        return None
    assert not isinstance(tolerance, str)
    return SyncCheck(policy, engine, policy.tokenizer, tolerance)
