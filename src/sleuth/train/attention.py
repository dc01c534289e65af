"""Attention masks for packed rows, from per-token segment and completion ids.

Rule (see packing.py): query i may attend key j when j <= i, both belong to the same segment,
and j is a prompt token or a token of i's own completion. Padding is its own segment (-1) and so
never mixes with real tokens.

Three ways to apply the rule, chosen by the model's attn_implementation:

- "sleuth_packed" (CPU default): our attention function, registered with transformers, that runs
  causal scaled_dot_product_attention per prompt and, per prompt's completions, a dense call to
  the prompt merged with their causal own blocks (completion_attention.py), so it does only the
  needed work and never builds a [T, T] mask. CPU SDPA with an arbitrary mask computes every block
  of the T x T score matrix, which for packed rows costs more than the sharing saves. Without a
  row layout it behaves exactly like "sdpa" (generation, plain batches); with attention dropout
  or off the CPU it falls back to the dense mask.
- "sdpa": a dense boolean mask [1, 1, T, T] (True = may attend), which transformers passes
  through unchanged as a prepared 4D mask. Simple and exact, O(T^2) memory and compute.
- "flex_attention" (CUDA): a BlockMask, which skips fully masked blocks (no CPU backward exists).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from sleuth.train.completion_attention import CompletionAttention
from sleuth.train.packing import PackedRow

PACKED = "sleuth_packed"


def backend_for(device: torch.device | str) -> str:
    """The transformers attn_implementation used for packed rows on this device."""
    if torch.device(device).type == "cuda":
        return "flex_attention"
    register_packed_attention()
    return PACKED


@dataclass(frozen=True)
class RowLayout:
    """Where prompts and completions sit in a packed row (for the sleuth_packed attention)."""

    length: int
    """Row length T, padding included."""
    segments: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]
    """(prompt_start, prompt_len, ((completion_start, completion_len), ...)) per prompt instance;
    each completion directly follows the previous one (or the prompt)."""
    segment_ids: torch.Tensor = field(compare=False)
    completion_ids: torch.Tensor = field(compare=False)
    """The row's per-token ids (packing.py), for the dense-mask fallback."""


def row_layout(row: PackedRow) -> RowLayout:
    segments: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for pl in row.placements:
        segments.setdefault((pl.prompt_start, pl.prompt_len), []).append((pl.start, pl.length))
    return RowLayout(row.length, tuple((ps, n, tuple(c)) for (ps, n), c in segments.items()),
                     row.segment_ids, row.completion_ids)


def _packed_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: RowLayout,
                 scaling: float | None) -> torch.Tensor:
    """[1, H, T, D] attention output of a packed row, prompt instance by prompt instance."""
    end = 0
    for ps, plen, comps in layout.segments:
        for s, n in ((ps, plen), *comps):
            if s != end:
                raise ValueError(f"row layout is not contiguous at {s} (expected {end})")
            end = s + n
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    # Head-major contiguous copies (a few MB; the model hands [1, T, H, D] storage viewed as
    # [1, H, T, D], which the CPU flash kernels read ~7% slower), with key/value heads repeated
    # to the query heads (the flash backward is ~10% faster without grouped-query indexing).
    query = query.contiguous()
    rep = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(rep, dim=1) if rep > 1 else t.contiguous() for t in (key, value))
    # One split per tensor, [prompt, its completions] per instance: a split's backward is a single
    # concatenation, where slicing each part would allocate a full-size zero gradient per slice.
    sizes = [n for _, plen, comps in layout.segments for n in (plen, sum(c for _, c in comps))]
    pad = layout.length - end
    qs, ks, vs = (t.split([*sizes, pad], dim=2) for t in (query, key, value))
    outs: list[torch.Tensor] = []
    for i, (_, _, comps) in enumerate(layout.segments):
        p, c = 2 * i, 2 * i + 1
        outs.append(F.scaled_dot_product_attention(qs[p], ks[p], vs[p], is_causal=True, scale=scale))
        if comps:
            outs.append(CompletionAttention.apply(qs[c], ks[p], vs[p], ks[c], vs[c], [n for _, n in comps], scale))
    if pad:  # padding: its output is never read
        outs.append(torch.zeros_like(qs[-1]))
    return torch.cat(outs, dim=2)


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, packed_layout: RowLayout | None = None,
                             attention_override: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: structured packed attention, or plain sdpa without a layout.

    `attention_override` (a forward keyword, like packed_layout): an object whose
    attend(module, query, key, value, scaling) computes the attention instead; the rollout engine's
    shared-prompt decoding uses it (rollout/shared_prefix.py)."""
    if attention_override is not None:
        return attention_override.attend(module, query, key, value, scaling)
    if packed_layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError("packed attention takes one row per forward pass")
    if dropout > 0 or query.device.type != "cpu":
        # The structured path calls the CPU flash kernels and has no dropout; the dense mask
        # (exact, O(T^2)) covers the rest. (Training on CUDA uses flex_attention, not this.)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        mask = dense_mask(packed_layout.segment_ids.to(query.device), packed_layout.completion_ids.to(query.device))
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    out = _packed_sdpa(query, key, value, packed_layout, scaling)
    return out.transpose(1, 2).contiguous(), None


_registered = False


def register_packed_attention() -> None:
    """Make attn_implementation="sleuth_packed" known to transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED, packed_attention_forward)
    AttentionMaskInterface.register(PACKED, sdpa_mask)
    _registered = True


def dense_mask(segment_ids: torch.Tensor, completion_ids: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] boolean mask, True where query (row) may attend key (column)."""
    t = segment_ids.numel()
    idx = torch.arange(t, device=segment_ids.device)
    mask = idx[None, :] <= idx[:, None]
    mask &= segment_ids[None, :] == segment_ids[:, None]
    mask &= (completion_ids[None, :] == 0) | (completion_ids[None, :] == completion_ids[:, None])
    return mask[None, None]


# ------------------------------------------------------------------ CUDA only (flex_attention)


def flex_block_mask(segment_ids: torch.Tensor, completion_ids: torch.Tensor) -> Any:
    """A flex_attention BlockMask with the same rule as dense_mask (tensors on the CUDA device),
    its block structure read from the row layout (block_mask.py) rather than searched for."""
    from sleuth.train.block_mask import layout_block_mask

    return layout_block_mask(segment_ids, completion_ids, packed_mask_mod(segment_ids, completion_ids))


def packed_mask_mod(segment_ids: torch.Tensor, completion_ids: torch.Tensor) -> Any:
    """flex_attention mask_mod(b, h, q_idx, kv_idx) -> bool with the packing rule."""
    seg, comp = segment_ids, completion_ids

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (kv <= q) & (seg[q] == seg[kv]) & ((comp[kv] == 0) | (comp[kv] == comp[q]))

    return mask_mod


def attention_kwargs(row: PackedRow, backend: str, device: torch.device) -> dict[str, Any]:
    """The model-forward keyword arguments that make its attention honour the packed layout."""
    if backend == PACKED:
        return {"attention_mask": None, "packed_layout": row_layout(row)}
    seg, comp = row.segment_ids.to(device), row.completion_ids.to(device)
    if backend == "flex_attention":
        return {"attention_mask": flex_block_mask(seg, comp)}
    # Any other implementation gets the dense mask; the trainer's self-check catches the ones
    # (such as "eager") that do not apply a boolean mask correctly.
    return {"attention_mask": dense_mask(seg, comp)}
