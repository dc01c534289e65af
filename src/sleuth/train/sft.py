"""The supervised step of `sleuth sft` (the run itself: sleuth/loop/sft.py).

Examples are packed into rows exactly like the RL step's groups (packing.py: one group per
example, its target as the one completion, so every target token is a target and the prompt's
tokens are inputs only); the loss is the mean token NLL over all target tokens of the batch, and
the optimizer is the trainer's (optim.py), kept with its schedule in one checkpointable state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from sleuth.records import Completion, Group, Problem
from sleuth.train.packing import PackedBatch, pack_groups


class SupervisedExample(Protocol):
    problem: Problem
    prompt_ids: list[int]
    target_ids: list[int]


def pack_examples(examples: Sequence[SupervisedExample], row_tokens: int, pad_to_multiple: int = 1) -> PackedBatch:
    """One group per example, the target as its only completion (every target token a target)."""
    groups = [Group(e.problem, e.prompt_ids,
                    [Completion([], e.target_ids, [0.0] * len(e.target_ids), "stop", "")], advantages=[1.0])
              for e in examples]
    return pack_groups(groups, row_tokens, pad_to_multiple=pad_to_multiple)


class OptimizerState:
    """The optimizer and its schedule as one checkpointable state (sleuth.run.checkpoint.HasState)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        self.optimizer, self.scheduler = optimizer, scheduler

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def sft_step(policy: Any, state: OptimizerState, batch: PackedBatch, grad_clip: float) -> dict[str, float]:
    """One optimizer step on the mean token NLL of the batch's targets."""
    n = batch.n_completion_tokens
    nll = 0.0
    for row in batch.rows:
        logp, _ = policy.row_logprobs(row)
        loss = -logp.float().sum() / n
        loss.backward()
        nll += float(loss.detach())
    params = policy.trainable_parameters()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    lr = state.optimizer.param_groups[0]["lr"]
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    return {"sft/loss": nll, "sft/grad_norm": grad_norm, "sft/lr": lr, "sft/target_tokens": n,
            "sft/tokens": batch.n_tokens, "sft/rows": len(batch.rows)}
