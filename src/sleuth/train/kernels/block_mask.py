"""A flex_attention BlockMask built from a packed row's layout instead of from its mask function.

`create_block_mask` finds the block structure by evaluating the mask function on all T x T
(query, key) pairs: for a 16k-token row that took 17-20 ms per row on an H200, as long as the
attention itself. A packed row's layout says where the answer can be non-empty without looking:
the packing rule (attention.py: key j is visible to query i iff j <= i < scope_end[j]) can only
allow a (query block, key block) pair when the key block is not after the query block and the
largest scope end of its keys reaches past the query block's first token. For Temporal-Clue-shaped
rows that leaves about one block pair in ten; only those are evaluated token by token with the
mask function (so the rule keeps one home, `packed_mask_mod`) and sorted into full and partial
blocks.

The result is exact (tests compare it block for block with create_block_mask), so the kernel
skips the same blocks either way. Works on any device; only the attention kernel needs CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

BLOCK = 128
"""flex_attention's default block size (query and key)."""


def _candidates(scope_end: torch.Tensor, block: int) -> torch.Tensor:
    """[nb, nb] (query block, key block) pairs that may hold an allowed pair of tokens: a superset
    of the non-empty blocks. An allowed (i, j) has j <= i, so key block <= query block, and
    i < scope_end[j], so the key block's largest scope end lies past the query block's start."""
    t = scope_end.numel()
    nb = -(-t // block)
    reach = F.pad(scope_end.long(), (0, nb * block - t), value=0).view(nb, block).amax(1)
    idx = torch.arange(nb, device=scope_end.device)
    return (idx[None, :] <= idx[:, None]) & (reach[None, :] > idx[:, None] * block)


def block_states(scope_end: torch.Tensor, mask_mod: Any, block: int = BLOCK,
                 chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) boolean [nb, nb] matrices over (query block, key block) pairs: the candidate
    blocks are evaluated token by token with `mask_mod` (in chunks of `chunk` blocks), the rest is
    empty without looking."""
    t = scope_end.numel()
    cand = _candidates(scope_end, block)
    partial = torch.zeros_like(cand)
    full = torch.zeros_like(cand)
    pairs = cand.nonzero()
    offs = torch.arange(block, device=scope_end.device)
    for c in range(0, pairs.shape[0], chunk):
        qb, kb = pairs[c:c + chunk, 0], pairs[c:c + chunk, 1]
        qi, ki = qb[:, None] * block + offs, kb[:, None] * block + offs  # [P, block] token indices
        q_ok, k_ok = qi < t, ki < t
        valid = q_ok[:, :, None] & k_ok[:, None, :]
        allowed = mask_mod(None, None, qi.clamp(max=t - 1)[:, :, None], ki.clamp(max=t - 1)[:, None, :])
        # As in create_block_mask, positions past T count as masked: a block that reaches past
        # the row end is never full.
        allowed = allowed & valid
        some = allowed.flatten(1).any(1)
        every = allowed.flatten(1).all(1)
        full[qb, kb] = some & every
        partial[qb, kb] = some & ~every
    return partial, full


def _as_kv_blocks(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts [1, 1, nb] and indices [1, 1, nb, nb] (the set blocks first, in order) of a state matrix."""
    nb = states.shape[0]
    counts = states.sum(1, dtype=torch.int32)
    # A stable sort on "not set" puts the set key blocks first, in increasing order.
    order = torch.sort((~states).to(torch.int8), dim=1, stable=True).indices.to(torch.int32)
    return counts.view(1, 1, nb), order.view(1, 1, nb, nb)


def layout_block_mask(scope_end: torch.Tensor, mask_mod: Any, block: int = BLOCK) -> Any:
    """A BlockMask for a packed row ([T] scope ends on the attention's device) with `mask_mod`
    applied inside partial blocks only."""
    from torch.nn.attention.flex_attention import BlockMask

    t = scope_end.numel()
    partial, full = block_states(scope_end, mask_mod, block)
    kv_num, kv_idx = _as_kv_blocks(partial)
    full_num, full_idx = _as_kv_blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(t, t))
