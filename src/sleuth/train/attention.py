"""Attention for packed rows of prefix trees (packing.py).

Rule: query i may attend key j when j <= i < scope_end[j], i.e. j lies on i's path from its root.
Padding keys have scope_end = their own position + 1, so padding never mixes with real tokens.

Three ways to apply the rule, chosen by the model's attn_implementation:

- "sleuth_packed" (CPU default): our attention function, registered with transformers, that runs
  causal scaled_dot_product_attention over each root span and, per node with children, one
  CompletionAttention call (completion_attention.py): the children's spans attend densely to the
  node's whole path and causally to themselves. For single-turn groups that is one call for the
  prompt and one for all its completions. It does only the needed work and never builds a [T, T]
  mask: CPU SDPA with an arbitrary mask computes every block of the T x T score matrix, which for
  packed rows costs more than the sharing saves. Without a row layout it behaves exactly like
  "sdpa" (generation, plain batches); with attention dropout or off the CPU it falls back to the
  dense mask.
- "sdpa": a dense boolean mask [1, 1, T, T] (True = may attend), which transformers passes
  through unchanged as a prepared 4D mask. Simple and exact, O(T^2) memory and compute.
- "flex_attention" (CUDA): a BlockMask, which skips fully masked blocks (no CPU backward exists).

Sliding-window layers (Mistral, Gemma 3, GPT-OSS) and attention sinks (GPT-OSS) change the rule:
a key further back than the window is dropped, and a per-head sink logit joins the softmax's
denominator. "sleuth_packed" reads both from the keyword arguments each layer passes (so hybrid
models get each layer's own rule) and then uses a dense mask with the window (by position, not
row index) and exact softmax-with-sink math; a window longer than every sequence in the row
changes nothing and keeps the structured path. The flex BlockMask is one mask for all layers, so
a model with windows or sinks trains on "sleuth_packed" on CUDA too (`backend_for`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from sleuth.train.completion_attention import CompletionAttention
from sleuth.train.packing import PackedRow

PACKED = "sleuth_packed"


def backend_for(device: torch.device | str, config: Any = None) -> str:
    """The transformers attn_implementation used for packed rows on this device (and model config)."""
    if torch.device(device).type == "cuda" and not (config is not None and special_attention(config)):
        return "flex_attention"
    register_packed_attention()
    return PACKED


def special_attention(config: Any) -> list[str]:
    """What in this model's attention the structured kernels (packed rows, shared-prompt decoding)
    do not cover: "sliding window N" and/or "attention sinks". Empty for plain causal attention."""
    found = []
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    uses_window = "sliding_attention" in layer_types or (not layer_types and getattr(config, "use_sliding_window", True))
    if window and uses_window:
        found.append(f"sliding window {window}")
    if getattr(config, "model_type", "") == "gpt_oss":  # the one transformers decoder with sink logits
        found.append("attention sinks")
    return found


@dataclass(frozen=True)
class Branch:
    """A node's children: their spans attend densely to the node's path and causally to themselves."""

    prefix: tuple[int, ...]
    """Pieces holding the path from the root to the node, in order (their keys, concatenated)."""
    queries: tuple[int, ...]
    """Pieces holding the children's spans: the block of leaf children first, then each other child."""
    sizes: tuple[int, ...]
    """Each child's span length, in the order of the concatenated query pieces."""


@dataclass(frozen=True)
class RowLayout:
    """A packed row cut into pieces that tile its real tokens (for the sleuth_packed attention)."""

    length: int
    """Row length T, padding included."""
    pieces: tuple[int, ...]
    """Sizes of consecutive row ranges: each root and inner node's span is a piece, and so is each
    node's block of leaf children (laid out back to back)."""
    roots: tuple[int, ...]
    """The piece of each tree's root span (causal attention within it)."""
    branches: tuple[Branch, ...]
    scope_end: torch.Tensor = field(compare=False)
    position_ids: torch.Tensor = field(compare=False)
    """The row's per-token scope ends and positions (packing.py), for the dense-mask fallback."""


def row_layout(row: PackedRow) -> RowLayout:
    nodes = row.nodes
    children: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        if node.parent >= 0:
            children[node.parent].append(i)
    leaf = [node.parent >= 0 and not children[i] for i, node in enumerate(nodes)]
    pieces: list[int] = []
    piece_of: list[int] = []
    end = 0
    for i, node in enumerate(nodes):  # row order
        if node.start != end:
            raise ValueError(f"row layout is not contiguous at {node.start} (expected {end})")
        end += node.length
        if i and leaf[i] and leaf[i - 1] and nodes[i - 1].parent == node.parent:
            pieces[-1] += node.length  # joins the block of its leaf siblings
        else:
            pieces.append(node.length)
        piece_of.append(len(pieces) - 1)
    branches = []
    for i, kids in enumerate(children):
        if not kids:
            continue
        path = [i]
        while nodes[path[-1]].parent >= 0:
            path.append(nodes[path[-1]].parent)
        leaves = [k for k in kids if leaf[k]]
        inner = [k for k in kids if not leaf[k]]
        queries = ([piece_of[leaves[0]]] if leaves else []) + [piece_of[k] for k in inner]
        if len({piece_of[k] for k in leaves}) > 1:
            raise ValueError(f"the leaf children of the node at {nodes[i].start} are not back to back")
        branches.append(Branch(tuple(piece_of[a] for a in reversed(path)), tuple(queries),
                               tuple(nodes[k].length for k in leaves + inner)))
    roots = tuple(piece_of[i] for i, node in enumerate(nodes) if node.parent < 0)
    return RowLayout(row.length, tuple(pieces), roots, tuple(branches), row.scope_end, row.position_ids)


def _join(parts: tuple[torch.Tensor, ...], which: tuple[int, ...]) -> torch.Tensor:
    """The given pieces along the sequence axis (a view when it is one piece)."""
    return parts[which[0]] if len(which) == 1 else torch.cat([parts[i] for i in which], dim=2)


def _packed_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: RowLayout,
                 scaling: float | None) -> torch.Tensor:
    """[1, H, T, D] attention output of a packed row: root spans, then each node's children."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    # Head-major contiguous copies (a few MB; the model hands [1, T, H, D] storage viewed as
    # [1, H, T, D], which the CPU flash kernels read ~7% slower), with key/value heads repeated
    # to the query heads (the flash backward is ~10% faster without grouped-query indexing).
    query = query.contiguous()
    rep = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(rep, dim=1) if rep > 1 else t.contiguous() for t in (key, value))
    # One split per tensor into the layout's pieces: a split's backward is a single concatenation,
    # where slicing each part would allocate a full-size zero gradient per slice.
    pad = layout.length - sum(layout.pieces)
    qs, ks, vs = (t.split([*layout.pieces, pad], dim=2) for t in (query, key, value))
    outs: list[torch.Tensor | None] = [None] * len(layout.pieces)
    for r in layout.roots:
        outs[r] = F.scaled_dot_product_attention(qs[r], ks[r], vs[r], is_causal=True, scale=scale)
    for b in layout.branches:
        out = CompletionAttention.apply(_join(qs, b.queries), _join(ks, b.prefix), _join(vs, b.prefix),
                                        _join(ks, b.queries), _join(vs, b.queries), list(b.sizes), scale)
        parts = (out,) if len(b.queries) == 1 else out.split([layout.pieces[i] for i in b.queries], dim=2)
        for i, part in zip(b.queries, parts, strict=True):
            outs[i] = part
    if pad:  # padding: its output is never read
        outs.append(torch.zeros_like(qs[-1]))
    return torch.cat(outs, dim=2)  # type: ignore[arg-type]  # every piece is a root or some node's child


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, packed_layout: RowLayout | None = None,
                             attention_override: Any = None, sliding_window: int | None = None,
                             s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: structured packed attention, or plain sdpa without a layout.

    `attention_override` (a forward keyword, like packed_layout): an object whose
    attend(module, query, key, value, scaling) computes the attention instead; the rollout engine's
    shared-prompt decoding uses it (rollout/shared_prefix.py). `sliding_window` and `s_aux` (sink
    logits) come from the layer itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_override is not None:
        return attention_override.attend(module, query, key, value, scaling)
    if packed_layout is None:
        if s_aux is None:  # transformers' mask already holds causality, padding and the window
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        if attention_mask is None:  # sdpa_mask left out a plain causal mask
            attention_mask = _causal_mask(query.shape[2], key.shape[2], sliding_window, query.device)
        return _dense_attention(module, query, key, value, attention_mask, dropout, scaling, s_aux)
    if query.shape[0] != 1:
        raise ValueError("packed attention takes one row per forward pass")
    window_bites = sliding_window is not None and int(packed_layout.position_ids.max()) >= sliding_window
    if dropout > 0 or query.device.type != "cpu" or window_bites or s_aux is not None:
        # The structured path calls the CPU flash kernels and has no dropout, window or sinks; the
        # dense mask (exact, O(T^2)) covers the rest. (CUDA training uses flex_attention unless the
        # model has windows or sinks, see backend_for.)
        mask = dense_mask(packed_layout.scope_end.to(query.device), packed_layout.position_ids.to(query.device),
                          sliding_window)
        if s_aux is not None:
            return _dense_attention(module, query, key, value, mask, dropout, scaling, s_aux)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    out = _packed_sdpa(query, key, value, packed_layout, scaling)
    return out.transpose(1, 2).contiguous(), None


def _causal_mask(q_len: int, k_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[1, 1, q_len, k_len] causal boolean mask, the queries being the last q_len positions."""
    q = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k = torch.arange(k_len, device=device)[None, :]
    mask = k <= q
    if window is not None:
        mask &= q - k < window
    return mask[None, None]


def _dense_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     mask: torch.Tensor, dropout: float, scaling: float | None,
                     sinks: torch.Tensor) -> tuple[torch.Tensor, None]:
    """Softmax attention with a per-head sink logit in the denominator (GPT-OSS), under a boolean
    (or additive) mask; [B, T, H, D] out. Float32 scores; the sink takes probability, no value."""
    rep = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(rep, dim=1) if rep > 1 else t for t in (key, value))
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = (query.float() @ key.float().transpose(-1, -2)) * scale
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    b, h, t, _ = scores.shape
    sink = sinks.float().reshape(1, h, 1, 1).expand(b, h, t, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = probs.to(value.dtype) @ value
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


def dense_mask(scope_end: torch.Tensor, position_ids: torch.Tensor | None = None,
               window: int | None = None) -> torch.Tensor:
    """[1, 1, T, T] boolean mask, True where query (row) may attend key (column); with a sliding
    window, keys `window` or more positions (in the sequence, not the row) back are dropped."""
    idx = torch.arange(scope_end.numel(), device=scope_end.device)
    mask = (idx[None, :] <= idx[:, None]) & (idx[:, None] < scope_end[None, :])
    if window is not None and position_ids is not None:
        mask &= position_ids[:, None] - position_ids[None, :] < window
    return mask[None, None]


# ------------------------------------------------------------------ CUDA only (flex_attention)


def flex_block_mask(scope_end: torch.Tensor) -> Any:
    """A flex_attention BlockMask with the same rule as dense_mask (tensor on the CUDA device),
    its block structure read from the row layout (block_mask.py) rather than searched for."""
    from sleuth.train.block_mask import layout_block_mask

    return layout_block_mask(scope_end, packed_mask_mod(scope_end))


def packed_mask_mod(scope_end: torch.Tensor) -> Any:
    """flex_attention mask_mod(b, h, q_idx, kv_idx) -> bool with the packing rule."""

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (kv <= q) & (q < scope_end[kv])

    return mask_mod


def attention_kwargs(row: PackedRow, backend: str, device: torch.device) -> dict[str, Any]:
    """The model-forward keyword arguments that make its attention honour the packed layout."""
    if backend == PACKED:
        return {"attention_mask": None, "packed_layout": row_layout(row)}
    scope_end = row.scope_end.to(device)
    if backend == "flex_attention":
        return {"attention_mask": flex_block_mask(scope_end)}
    # Any other implementation gets the dense mask; the trainer's self-check catches the ones
    # (such as "eager") that do not apply a boolean mask correctly.
    return {"attention_mask": dense_mask(scope_end)}
