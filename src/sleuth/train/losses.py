"""Policy losses (a registry), the k3 KL estimate, truncated IS weights and aggregation weights.

Losses return per-token values; how tokens become one number is chosen once, outside them, as a
per-token weight computed from global counts before any backward pass (aggregation_weights).
The total loss is sum(weight * token_loss) over every token of every row, so the result does not
depend on how tokens were split into rows or micro-batches.

A policy loss is `fn(logp, old_logp, advantages, token_seq, clip_low, clip_high) -> PolicyLoss`
over the N completion tokens of one packed row (token_seq: [N] sequence index of each token).
Add one with `@register_loss("name")`, or name it in the config as "module:function" /
"path/file.py:function" (checked when the config loads: importable, callable, six arguments).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sleuth.errors import UserError
from sleuth.plugins import Registry


@dataclass
class PolicyLoss:
    token_loss: torch.Tensor
    """[N] per-token policy-gradient loss (to be weighted and summed)."""
    clipped_low: torch.Tensor
    """[N] bool: the lower clip bound is active (ratio below 1 - clip_low with a negative advantage)."""
    clipped_high: torch.Tensor
    """[N] bool: the upper clip bound is active (ratio above 1 + clip_high with a positive advantage)."""


LossFn = Callable[..., PolicyLoss]

SIGNATURE = "fn(logp, old_logp, advantages, token_seq, clip_low, clip_high) -> PolicyLoss"
"""The documented signature of a policy loss (built-in, registered or user)."""

LOSSES = Registry("policy loss", 6, SIGNATURE)
"""Registered loss name -> function (the built-ins below, plus @register_loss ones)."""

register_loss = LOSSES.register
"""Decorator: @register_loss("name") makes a function the policy loss algorithm.loss=name."""

get_loss = LOSSES.resolve
"""The loss a config names: a registered name or a user "module:function"."""

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "constant")


def _clipped_objective(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> PolicyLoss:
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    # Pessimistic (min) objective; the loss is its negative.
    token_loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        low = (ratio < 1.0 - clip_low) & (advantages < 0)
        high = (ratio > 1.0 + clip_high) & (advantages > 0)
    return PolicyLoss(token_loss, low, high)


@register_loss("ppo_clip")
def ppo_clip(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, token_seq: torch.Tensor,
    clip_low: float, clip_high: float,
) -> PolicyLoss:
    """Token-level ratio exp(logp - old_logp), clipped to [1 - clip_low, 1 + clip_high]."""
    ratio = torch.exp(logp - old_logp)
    return _clipped_objective(ratio, advantages, clip_low, clip_high)


@register_loss("gspo")
def gspo(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, token_seq: torch.Tensor,
    clip_low: float, clip_high: float,
) -> PolicyLoss:
    """Sequence-level ratio s = exp(mean over the sequence of (logp - old_logp)), clipped.

    Written per token as sg[s] * exp(logp - sg[logp]): the value is s on every token and the
    gradient is s times the token's score, which with sequence-mean aggregation is GSPO's gradient.
    """
    seqs, inverse = torch.unique(token_seq, return_inverse=True)
    diff = logp - old_logp
    sums = torch.zeros(seqs.numel(), dtype=diff.dtype, device=diff.device).index_add(0, inverse, diff)
    counts = torch.zeros(seqs.numel(), dtype=diff.dtype, device=diff.device).index_add(
        0, inverse, torch.ones_like(diff)
    )
    seq_ratio = torch.exp(sums / counts)[inverse]
    ratio = seq_ratio.detach() * torch.exp(logp - logp.detach())
    return _clipped_objective(ratio, advantages, clip_low, clip_high)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(r) - r - 1 with r = ref - logp (>= 0)."""
    r = ref_logp - logp
    return torch.exp(r) - r - 1.0


def tis_weights(old_logp: torch.Tensor, engine_logp: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Truncated importance weights min(exp(old - engine), cap) correcting the engine/trainer mismatch."""
    if cap is None:
        return torch.ones_like(old_logp)
    if cap <= 0:
        raise UserError(f"algorithm.tis_cap must be positive or null, got {cap}")
    return torch.exp(old_logp - engine_logp).clamp(max=cap)


def aggregation_weights(seq_lengths: torch.Tensor, mode: str, max_tokens: int) -> torch.Tensor:
    """[S] weight of each token of sequence s, from the global counts of the whole batch.

    token_mean: 1 / (all completion tokens); seq_mean_token_mean: 1 / (len_s * sequences);
    constant (Dr.GRPO): 1 / (max_tokens * sequences).
    """
    n_seqs = seq_lengths.numel()
    lengths = seq_lengths.to(torch.float64)
    if mode == "token_mean":
        w = torch.full_like(lengths, 1.0 / float(lengths.sum()))
    elif mode == "seq_mean_token_mean":
        w = 1.0 / (lengths * n_seqs)
    elif mode == "constant":
        if max_tokens < 1:
            raise UserError(f"constant aggregation needs max_tokens >= 1, got {max_tokens}")
        w = torch.full_like(lengths, 1.0 / (max_tokens * n_seqs))
    else:
        raise UserError(f"unknown aggregation '{mode}' (choose from {', '.join(AGGREGATIONS)})")
    return w.to(torch.float32)
