"""Packed rows of prefix trees (packing.py) meet attention: the row layout and the mask per backend.

Rule: query i may attend key j when j <= i < scope_end[j], i.e. j lies on i's path from its root.
Padding keys have scope_end = their own position + 1, so padding never mixes with real tokens.

Three ways to apply the rule, chosen by the model's attn_implementation:

- "sleuth_packed" (CPU default; the function itself is in sleuth/system/attention.py, shared with the
  rollout stage): the row's RowLayout runs causal scaled_dot_product_attention over each root span
  and, per node with children, one CompletionAttention call (completion_attention.py): the
  children's spans attend densely to the node's whole path and causally to themselves. For
  single-turn groups that is one call for the prompt and one for all its completions. It does only
  the needed work and never builds a [T, T] mask: CPU SDPA with an arbitrary mask computes every
  block of the T x T score matrix, which for packed rows costs more than the sharing saves.
- "sdpa": a dense boolean mask [1, 1, T, T] (True = may attend), which transformers passes
  through unchanged as a prepared 4D mask. Simple and exact, O(T^2) memory and compute.
- "flex_attention" (CUDA): a BlockMask, which skips fully masked blocks (no CPU backward exists).
  It is one mask for all layers, so a model with sliding windows or attention sinks trains on
  "sleuth_packed" on CUDA too (`backend_for`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from sleuth.system.attention import PACKED, dense_mask, register_packed_attention, special_attention
from sleuth.train.kernels.completion_attention import CompletionAttention
from sleuth.train.kernels.recompute import recipe_scope
from sleuth.train.packing import PackedRow


def backend_for(device: torch.device | str, config: Any = None) -> str:
    """The transformers attn_implementation used for packed rows on this device (and model config)."""
    if torch.device(device).type == "cuda" and not (config is not None and special_attention(config)):
        return "flex_attention"
    register_packed_attention()
    return PACKED


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

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None) -> torch.Tensor:
        """[1, T, H, D] attention output of the row, contiguous (what sleuth/system/attention.py calls on CPU)."""
        return _packed_sdpa(query, key, value, self, scaling)


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
    """[1, T, H, D] attention output of a packed row (contiguous, as the output projection reads
    it): root spans, then each node's children."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    # Head-major contiguous copies (a few MB; the model hands [1, T, H, D] storage viewed as
    # [1, H, T, D], which the CPU flash kernels read ~7% slower), with key/value heads repeated
    # to the query heads (the flash backward is ~10% faster without grouped-query indexing).
    query = query.contiguous()
    rep = query.shape[1] // key.shape[1]
    if not torch.is_grad_enabled():
        key, value = (t.repeat_interleave(rep, dim=1) if rep > 1 else t.contiguous() for t in (key, value))
        return _token_major(_attend_pieces(query, key, value, layout, scale))
    with recipe_scope() as recipes:
        if rep > 1:  # the repeats are rebuilt in backward from the key/value heads, kept instead
            heads = [t.detach() for t in (key, value)]
            key, value = (t.repeat_interleave(rep, dim=1) for t in (key, value))
            recipes.add(key, _repeat(heads[0], rep))
            recipes.add(value, _repeat(heads[1], rep))
        else:
            key, value = key.contiguous(), value.contiguous()
        outs = _attend_pieces(query, key, value, layout, scale)
        out = _token_major(outs)
        # The output projection's LoRA keeps its input: rebuilt from the pieces, which the
        # attention calls keep for their own backward (the padding piece is a few zeros).
        pieces = [o.detach() for o in outs]
        recipes.add(out, lambda: _token_major(pieces))
        return out


def _token_major(outs: list[torch.Tensor]) -> torch.Tensor:
    """The pieces' outputs [1, H, t, D] joined along the sequence, as [1, T, H, D] contiguous."""
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _repeat(heads: torch.Tensor, rep: int) -> Callable[[], torch.Tensor]:
    return lambda: heads.repeat_interleave(rep, dim=1)


def _attend_pieces(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: RowLayout,
                   scale: float) -> list[torch.Tensor]:
    """Each piece's output [1, H, t, D], in row order (padding last, as zeros)."""
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
    return outs  # type: ignore[return-value]  # every piece is a root or some node's child


# ------------------------------------------------------------------ CUDA only (flex_attention)


def flex_block_mask(scope_end: torch.Tensor) -> Any:
    """A flex_attention BlockMask with the same rule as dense_mask (tensor on the CUDA device),
    its block structure read from the row layout (block_mask.py) rather than searched for."""
    from sleuth.train.kernels.block_mask import layout_block_mask

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
