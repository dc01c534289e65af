"""Attention masks for packed rows, from per-token segment and completion ids.

Rule (see packing.py): query i may attend key j when j <= i, both belong to the same segment,
and j is a prompt token or a token of i's own completion. Padding is its own segment (-1) and so
never mixes with real tokens.

Three ways to apply the rule, chosen by the model's attn_implementation:

- "sleuth_packed" (CPU default): our attention function, registered with transformers, that runs
  scaled_dot_product_attention per prompt (causal) and per prompt's completions (keys = [prompt |
  own tokens], completions of similar length stacked into one call), so it does only the needed
  work and never builds a [T, T] mask. CPU SDPA with an arbitrary
  mask computes every block of the T x T score matrix, which for packed rows costs more than the
  sharing saves. Without a row layout it behaves exactly like "sdpa" (generation, plain batches).
- "sdpa": a dense boolean mask [1, 1, T, T] (True = may attend), which transformers passes
  through unchanged as a prepared 4D mask. Simple and exact, O(T^2) memory and compute.
- "flex_attention" (CUDA): a BlockMask, which skips fully masked blocks (no CPU backward exists).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from sleuth.train.packing import PackedRow

PACKED = "sleuth_packed"
RECOMPUTE_RATIO = 2.3
"""CPU SDPA with an explicit mask costs ~1.65x per score what the causal kernel does (which also
skips the upper triangle): a completion of n tokens after a prompt of p is cheaper as a causal
pass over all p + n queries when p < 2.3 n (measured on the development machine)."""


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


def row_layout(row: PackedRow) -> RowLayout:
    segments: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for pl in row.placements:
        segments.setdefault((pl.prompt_start, pl.prompt_len), []).append((pl.start, pl.length))
    return RowLayout(row.length, tuple((ps, n, tuple(c)) for (ps, n), c in segments.items()))


def _packed_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: RowLayout,
                 scaling: float | None, dropout: float, gqa: bool) -> torch.Tensor:
    """[1, H, T, D] attention output of a packed row, segment by segment."""
    kw = {"scale": scaling, "dropout_p": dropout, "enable_gqa": gqa}
    sizes: list[int] = []
    end = 0
    for ps, plen, comps in layout.segments:
        for s, n in ((ps, plen), *comps):
            if s != end:
                raise ValueError(f"row layout is not contiguous at {s} (expected {end})")
            sizes.append(n)
            end = s + n
    pad = layout.length - end
    # One split per tensor: its backward is a single concatenation, where slicing each part
    # separately would allocate a full-size zero gradient per slice.
    qs, ks, vs = (t.split([*sizes, pad], dim=2) for t in (query, key, value))
    outs: list[torch.Tensor] = []
    i = 0
    for _, plen, comps in layout.segments:
        p_idx = i
        outs.append(F.scaled_dot_product_attention(qs[p_idx], ks[p_idx], vs[p_idx], is_causal=True, **kw))
        first = i + 1
        i += 1 + len(comps)
        parts: dict[int, torch.Tensor] = {}
        masked = []
        for j, (_, n) in enumerate(comps):
            c = first + j
            if plen < RECOMPUTE_RATIO * n:
                # Short prompt: the causal kernel over [prompt | completion] queries (prompt rows
                # recomputed and dropped) is cheaper than the masked kernel over the full block.
                q = torch.cat([qs[p_idx], qs[c]], dim=2)
                k = torch.cat([ks[p_idx], ks[c]], dim=2)
                v = torch.cat([vs[p_idx], vs[c]], dim=2)
                parts[c] = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)[:, :, plen:]
            else:
                masked.append(c)
        for batch in _length_buckets(masked, sizes):
            parts.update(_prompt_and_own_attention(qs, ks, vs, p_idx, batch, sizes, kw))
        outs.extend(parts[c] for c in range(first, i))
    if pad:  # padding: its output is never read
        outs.append(torch.zeros_like(qs[-1]))
    return torch.cat(outs, dim=2)


PAD_WASTE = 1.25
"""Completions of one prompt are batched into one masked attention call while the padded block
(count x longest) stays within this factor of their real tokens."""


def _length_buckets(parts: list[int], sizes: list[int]) -> list[list[int]]:
    """Groups of part indices, longest first, each padded to its longest within PAD_WASTE."""
    order = sorted(parts, key=lambda c: -sizes[c])
    buckets: list[list[int]] = []
    for c in order:
        if buckets:
            b = buckets[-1]
            if (len(b) + 1) * sizes[b[0]] <= PAD_WASTE * (sum(sizes[x] for x in b) + sizes[c]):
                b.append(c)
                continue
        buckets.append([c])
    return buckets


def _prompt_and_own_attention(qs: tuple[torch.Tensor, ...], ks: tuple[torch.Tensor, ...],
                              vs: tuple[torch.Tensor, ...], p_idx: int, batch: list[int], sizes: list[int],
                              kw: dict[str, Any]) -> dict[int, torch.Tensor]:
    """Completions `batch` of one prompt in one masked call: keys [prompt | own tokens], the
    completions stacked on the batch dimension (one kernel call instead of one per completion;
    CPU SDPA also runs its threads over batch x heads). Returns each completion's [1, H, n, D]."""
    plen = sizes[p_idx]
    m = sizes[batch[0]]  # the longest: buckets are sorted longest first
    k_count = len(batch)

    def stacked(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.cat([F.pad(parts[c], (0, 0, 0, m - sizes[c])) for c in batch], dim=0)

    q = stacked(qs)
    k = torch.cat([ks[p_idx].expand(k_count, -1, -1, -1), stacked(ks)], dim=2)
    v = torch.cat([vs[p_idx].expand(k_count, -1, -1, -1), stacked(vs)], dim=2)
    lengths = torch.tensor([sizes[c] for c in batch], device=q.device)
    own = torch.arange(m, device=q.device)
    # Prompt keys: all visible. Own keys: causal and real (padding rows of the queries see their
    # real prefix too, so no row is fully masked; their outputs are dropped).
    own_mask = (own[None, :] <= own[:, None])[None] & (own[None, None, :] < lengths[:, None, None])
    mask = torch.cat([torch.ones(k_count, m, plen, dtype=torch.bool, device=q.device), own_mask], dim=2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], **kw)
    return {c: out[r : r + 1, :, : sizes[c]] for r, c in enumerate(batch)}


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
    gqa = query.shape[1] != key.shape[1]
    out = _packed_sdpa(query, key, value, packed_layout, scaling, dropout, gqa)
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
    """A flex_attention BlockMask with the same rule as dense_mask (tensors on the CUDA device)."""
    from torch.nn.attention.flex_attention import create_block_mask

    t = segment_ids.numel()
    mask_mod = packed_mask_mod(segment_ids, completion_ids)
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=t, KV_LEN=t, device=segment_ids.device)


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
