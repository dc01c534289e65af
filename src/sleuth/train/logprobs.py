"""Per-token logprobs and entropies from hidden states, in chunks, with float32 logits.

    logp, entropy = token_logprobs(hidden, lm_head, targets)     # hidden [N, H] predicts targets [N]

Only completion-predicting positions reach this function, so a 16k-token row never holds a full
[tokens, vocab] float32 logits tensor: at most one chunk of LOGIT_CHUNK rows exists at a time.

The gradient is written out instead of left to autograd. For logp_i = logits_i[t_i] - lse_i,
    d logp_i / d hidden_i = W[t_i] - p_i @ W = -(p_i - e_{t_i}) @ W
When the head weight is frozen (LoRA), that [N, H] basis is computed in the forward pass, while
the chunk's probabilities are at hand; backward only scales it by the incoming gradient. This
replaces a checkpointed chunk (forward, recomputed forward, backward: three vocabulary-sized
matmuls and two softmaxes) with two matmuls and one softmax. When the weight is trained (full
fine-tuning; it is usually tied to the input embedding), its gradient needs the incoming gradient,
so the chunk's p - e_t is kept for backward (in the head's dtype, within KEEP_BUDGET_BYTES) or,
past that budget, its logits are recomputed there.
Constrained decoding (rollout.structured_output): `token_bitmask` [N, ceil(V/32)] int32 gives the
tokens the grammar allowed at each position (bit j of word w: token 32w + j, xgrammar's layout);
disallowed logits are set to a large negative number before the softmax, so logprobs, entropies
and the gradient are the constrained policy's, the distribution the engine sampled from. A token
the grammar forced has logprob 0 and no gradient.
The entropies carry no gradient unless asked (`entropy_grad=True`, for algorithm.entropy_coef):
d H_i / d logits_i = -p_i * (log p_i + H_i), so a frozen head saves a second [N, H] basis
(p_i * (log p_i + H_i)) @ W in the forward pass, and a trained head recomputes its chunks in
backward (keeping two vocabulary-sized tensors per chunk would halve what KEEP_BUDGET_BYTES holds).
Precision: the logits, the log-softmax, logprobs and entropies are float32; the gradient matmuls
run in the head's dtype (bf16 gradients, as in any bf16 training). Measured on SmolLM2-135M over
1,500 tokens of English text: bf16 logits (rounded to 8 significant bits, then upcast) would move
logprobs by 0.024 nats on average and up to 0.17, as much as a log-softmax taken in bf16 (0.026),
for a 1.8x faster product; the float32 product is kept.
"""

from __future__ import annotations

from typing import Any

import torch

from sleuth.errors import UserError

LOGIT_CHUNK = 1024
"""Completion tokens per lm_head chunk: [1024, vocab] float32 is 200 MB for a 49k vocabulary."""


def _logits(hidden: torch.Tensor, weight_f32: torch.Tensor) -> torch.Tensor:
    """Float32 logits [N, V] (see the precision note above)."""
    return hidden.float() @ weight_f32.T


MASKED_LOGIT = -1e30
"""Logit of a token the grammar disallows: exp() underflows to 0, and unlike -inf, 0 x MASKED_LOGIT
is 0, so the entropy's sum stays finite (float32 holds it: its limit is 3.4e38)."""


def unpack_bitmask(bitmask: torch.Tensor, vocab: int, targets: torch.Tensor) -> torch.Tensor:
    """[N, vocab] bool allowed tokens from a [N, W] int32 bitmask; ids past 32 W are disallowed.
    Each target stays allowed (a sampled token the grammar refused would otherwise get logprob
    -1e30: the sampler counts such tokens, rollout/constraint_refused)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(bitmask.shape[0], -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    allowed = allowed[:, :vocab]
    allowed[torch.arange(targets.shape[0], device=targets.device), targets] = True
    return allowed


_Stats = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _softmax_stats(logits: torch.Tensor, targets: torch.Tensor, dlogits_dtype: torch.dtype | None = None,
                   allowed: torch.Tensor | None = None, entropy_dir: bool = False) -> _Stats:
    """(logp [N], entropy [N], p - e_t [N, V] in dlogits_dtype or None, p * (log p + H) [N, V] in
    dlogits_dtype when `entropy_dir`, else None) from float32 logits, restricted to the `allowed`
    tokens [N, V] when given (constrained decoding). The last is -(d entropy / d logits).

    Overwrites `logits`. Few passes over the vocabulary-sized buffer, since on CPU each pass costs
    about as much as a tenth of the lm_head matmul: shift by the row max in place, one exp into a
    second buffer, then sums, one in-place scaling and one cast to the dtype of the gradient matmul.
    """
    if allowed is not None:
        logits.masked_fill_(~allowed, MASKED_LOGIT)
    shifted = logits.sub_(logits.amax(-1, keepdim=True))
    exp = torch.exp(shifted)
    total = exp.sum(-1, keepdim=True)
    log_total = total.log()
    logp = shifted.gather(-1, targets[:, None])[:, 0] - log_total[:, 0]
    # entropy = log Z - sum(e^x * x) / Z with x the shifted logits, Z the sum of e^x
    dot = torch.bmm(exp[:, None, :], shifted[:, :, None])[:, 0]
    entropy = (log_total - dot / total)[:, 0]
    if dlogits_dtype is None:
        return logp, entropy, None, None
    probs = exp.mul_(total.reciprocal())  # in place, then one cast (a dividing cast is 2x slower)
    direction = None
    if entropy_dir:  # log p + H = x - log Z + H, in the logits' buffer (not needed after this)
        direction = shifted.sub_(log_total - entropy[:, None]).mul_(probs).to(dlogits_dtype)
    probs[torch.arange(targets.shape[0], device=targets.device), targets] -= 1.0
    return logp, entropy, probs.to(dlogits_dtype), direction


KEEP_BUDGET_BYTES = 1 << 30
"""With a trained head, each chunk's p - e_t (head dtype) is kept for backward while the call's
total stays within this budget (1,600 tokens x 49k vocab in bf16: 157 MB); beyond it, chunks
recompute their logits in backward (one more float32 matmul and softmax each)."""

BASIS, KEEP, RECOMPUTE = "basis", "keep", "recompute"


class _ChunkLogprobs(torch.autograd.Function):
    """(logp, entropy) of one chunk; `mode` says what backward works from (see the module doc):
    BASIS (frozen head: the hidden-state gradient itself), KEEP (p - e_t) or RECOMPUTE. The
    entropy is differentiable only with `entropy_grad` (KEEP is then never chosen)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, weight_f32: torch.Tensor,
                targets: torch.Tensor, mode: str, allowed: torch.Tensor | None,
                entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.mode, ctx.entropy_grad = mode, entropy_grad
        ctx.allowed = allowed  # no gradient: kept as an attribute for a recomputing backward
        logp, entropy, probs, direction = _softmax_stats(
            _logits(hidden, weight_f32), targets, None if mode == RECOMPUTE else weight.dtype, allowed,
            entropy_dir=entropy_grad and mode == BASIS)
        if mode == BASIS:
            assert probs is not None
            # -(d logp / d hidden), then -(d entropy / d hidden) when the entropy is trained
            ctx.save_for_backward(probs @ weight, *([] if direction is None else [direction @ weight]))
        elif mode == KEEP:
            ctx.save_for_backward(hidden, weight, probs)
        else:
            ctx.save_for_backward(hidden, weight, weight_f32, targets)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None) -> tuple[Any, ...]:
        with_entropy = ctx.entropy_grad and grad_entropy is not None
        if ctx.mode == BASIS:
            basis, *entropy_basis = ctx.saved_tensors
            grad = basis.float() * -grad_logp[:, None]
            if with_entropy:
                grad -= entropy_basis[0].float() * grad_entropy[:, None]
            return grad.to(basis.dtype), None, None, None, None, None, None
        direction = None
        if ctx.mode == KEEP:
            hidden, weight, probs = ctx.saved_tensors
        else:
            hidden, weight, weight_f32, targets = ctx.saved_tensors
            _, _, probs, direction = _softmax_stats(_logits(hidden, weight_f32), targets, torch.float32,
                                                    ctx.allowed, entropy_dir=with_entropy)
        assert probs is not None
        grad_logits = probs * -grad_logp[:, None].to(probs.dtype)
        if direction is not None:
            grad_logits -= direction * grad_entropy[:, None]
        grad_logits = grad_logits.to(weight.dtype)
        grad_hidden = grad_logits @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_logits.T @ hidden.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, chunk: int = LOGIT_CHUNK,
    token_bitmask: torch.Tensor | None = None, entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target and the entropy of each predictive distribution, chunked.

    hidden: [N, H] states that predict targets [N]. The entropy carries no gradient (it is logged)
    unless `entropy_grad` (an entropy term in the loss).
    token_bitmask: [N, W] int32, the tokens allowed at each position (constrained decoding; see
    the module doc), or None for the unconstrained distribution.
    """
    if getattr(lm_head, "bias", None) is not None:
        raise UserError("lm_head with a bias is not supported by the chunked logprob computation")
    weight = lm_head.weight
    with torch.no_grad():
        weight_f32 = weight.float()  # once per call, not per chunk (a copy for a bf16 head)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, entropies = [], []
    kept = 0
    for s in range(0, hidden.shape[0], chunk):
        h, t = hidden[s : s + chunk], targets[s : s + chunk]
        allowed = None if token_bitmask is None else unpack_bitmask(token_bitmask[s : s + chunk], weight.shape[0], t)
        if grad:
            mode = BASIS
            if weight.requires_grad:
                size = h.shape[0] * weight.shape[0] * weight.element_size()
                mode = KEEP if kept + size <= KEEP_BUDGET_BYTES and not entropy_grad else RECOMPUTE
                kept += size if mode == KEEP else 0
            lp, ent = _ChunkLogprobs.apply(h, weight, weight_f32, t, mode, allowed, entropy_grad)
        else:
            lp, ent, _, _ = _softmax_stats(_logits(h, weight_f32), t, allowed=allowed)  # no gradient buffer
        logps.append(lp)
        entropies.append(ent)
    return torch.cat(logps), torch.cat(entropies)
