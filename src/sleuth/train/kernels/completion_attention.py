"""Attention of one prompt's completions in a packed row (CPU): dense to the prompt, causal to their own.

A completion token attends to every token of its prompt and to its own earlier tokens. The two key
sets are attended separately and merged exactly by their log-sum-exps:

    out = out_p * exp(lse_p - lse) + out_o * exp(lse_o - lse),   lse = logaddexp(lse_p, lse_o)

- prompt part: one dense flash-attention call with all of the prompt's completions as queries and
  no mask. The CPU kernel computes every score of every tile it visits, so a dense block is where
  it wastes nothing; one large call also keeps both cores busy.
- own part: each completion's causal block by the causal flash kernel, completions of similar
  length stacked into one batch (padding at the end of each, which causality keeps out of the real
  rows). Plain float32 or bf16 matmuls were no faster for these blocks in place, even at 128 tokens.

Backward: given the merged output and log-sum-exp, the flash backward of each part returns exactly
that part's share of the gradients (its softmax weights are exp(s - lse) with the merged lse, and the
rowsum(dO * O) term uses the merged output), so the two query gradients add up. This is why the
aten flash ops are called directly: the forward returns its log-sum-exp, the backward accepts one.

Measured per layer on SmolLM2-135M shapes (prompt 1,000 + 8 x 200, bf16, forward + backward), against
the previous single masked call over [prompt | own] keys: see docs/benchmarks.md (train_step).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

PAD_WASTE = 1.25
"""Completions are stacked into one own-block batch while the padded block (count x longest) stays
within this factor of their real tokens."""


def length_buckets(sizes: list[int]) -> list[list[int]]:
    """Indices into sizes, longest first, grouped so that each group padded to its longest stays
    within PAD_WASTE of its real tokens."""
    order = sorted(range(len(sizes)), key=lambda c: -sizes[c])
    buckets: list[list[int]] = []
    for c in order:
        if buckets:
            b = buckets[-1]
            if (len(b) + 1) * sizes[b[0]] <= PAD_WASTE * (sum(sizes[x] for x in b) + sizes[c]):
                b.append(c)
                continue
        buckets.append([c])
    return buckets


def _stack(parts: tuple[torch.Tensor, ...], bucket: list[int], sizes: list[int]) -> torch.Tensor:
    """[len(bucket), ...] from parts [1, H, n, (D)] split on dim 2, each zero-padded to the longest."""
    m = sizes[bucket[0]]
    trailing = (0, 0) * (parts[0].dim() - 3)
    return torch.cat([F.pad(parts[c], (*trailing, 0, m - sizes[c])) for c in bucket])


def _unstack(stacked: torch.Tensor, bucket: list[int], sizes: list[int], dest: tuple[torch.Tensor, ...]) -> None:
    """Copy each real part of a stacked batch into its view in dest (a tensor split on dim 2)."""
    for r, c in enumerate(bucket):
        dest[c].copy_(stacked[r : r + 1, :, : sizes[c]])


def _wide(t: torch.Tensor) -> torch.Tensor:
    """t in at least float32 (the merge runs in float32, or float64 if given)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class CompletionAttention(torch.autograd.Function):
    """out [1, H, N, D] for one prompt's N completion tokens (back to back, lengths `sizes`).

    Arguments: q [1, H, N, D]; k_prompt, v_prompt [1, H, P, D]; k_own, v_own [1, H, N, D] (key/value
    heads already repeated to H); sizes; scale. No dropout."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k_prompt: torch.Tensor, v_prompt: torch.Tensor, k_own: torch.Tensor,
                v_own: torch.Tensor, sizes: list[int], scale: float) -> torch.Tensor:
        out_p, lse_p = _FLASH(q, k_prompt, v_prompt, 0.0, False, scale=scale)
        out_o, lse_o = torch.empty_like(out_p), torch.empty_like(lse_p)
        out_o_parts, lse_o_parts = out_o.split(sizes, dim=2), lse_o.split(sizes, dim=2)
        buckets = length_buckets(sizes)
        qs, ks, vs = (t.split(sizes, dim=2) for t in (q, k_own, v_own))
        for b in buckets:
            o, lse = _FLASH(_stack(qs, b, sizes), _stack(ks, b, sizes), _stack(vs, b, sizes), 0.0, True, scale=scale)
            _unstack(o, b, sizes, out_o_parts)
            _unstack(lse, b, sizes, lse_o_parts)
        lse = torch.logaddexp(lse_p, lse_o, out=torch.empty_like(lse_p))  # keeps the kernel's layout
        out = torch.empty_like(out_p)
        torch.add(_wide(out_p) * (lse_p - lse).exp_()[..., None],
                  _wide(out_o) * (lse_o - lse).exp_()[..., None], out=out)
        ctx.save_for_backward(q, k_prompt, v_prompt, k_own, v_own, out, lse)
        ctx.sizes, ctx.buckets, ctx.scale = sizes, buckets, scale
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[Any, ...]:
        q, k_prompt, v_prompt, k_own, v_own, out, lse = ctx.saved_tensors
        sizes, scale = ctx.sizes, ctx.scale
        d_out = d_out.contiguous()
        d_q, d_kp, d_vp = _FLASH_BACKWARD(d_out, q, k_prompt, v_prompt, out, lse, 0.0, False, scale=scale)
        d_q_own, d_ko, d_vo = (torch.empty_like(t) for t in (q, k_own, v_own))
        dests = [t.split(sizes, dim=2) for t in (d_q_own, d_ko, d_vo)]
        parts = [t.split(sizes, dim=2) for t in (d_out, q, k_own, v_own, out, lse)]
        for b in ctx.buckets:
            d_o, q_b, k_b, v_b, out_b, lse_b = (_stack(p, b, sizes) for p in parts)
            grads = _FLASH_BACKWARD(d_o, q_b, k_b, v_b, out_b, lse_b, 0.0, True, scale=scale)
            for g, dest in zip(grads, dests, strict=True):
                _unstack(g, b, sizes, dest)
        return d_q + d_q_own, d_kp, d_vp, d_ko, d_vo, None, None
