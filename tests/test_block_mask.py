"""The layout-built BlockMask equals create_block_mask's, block for block (built on the CPU)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from sleuth.train.attention import flex_block_mask, packed_mask_mod
from sleuth.train.block_mask import block_states, layout_block_mask


def _row(rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed-row ids: prompts with completions of random lengths, then padding."""
    seg: list[int] = []
    comp: list[int] = []
    next_comp = 1
    for g in range(rng.randint(1, 4)):
        plen = rng.randint(1, 90)
        seg += [g] * plen
        comp += [0] * plen
        for _ in range(rng.randint(0, 5)):
            n = rng.randint(1, 70)
            seg += [g] * n
            comp += [next_comp] * n
            next_comp += 1
    pad = rng.choice([0, 0, rng.randint(1, 40)])
    return torch.tensor(seg + [-1] * pad), torch.tensor(comp + [0] * pad)


def _reference(seg: torch.Tensor, comp: torch.Tensor, block: int) -> Any:
    t = seg.numel()
    return create_block_mask(packed_mask_mod(seg, comp), None, None, t, t, device="cpu", BLOCK_SIZE=block)


@pytest.mark.parametrize("seed", range(12))
def test_layout_block_mask_equals_create_block_mask(seed: int) -> None:
    rng = random.Random(seed)
    seg, comp = _row(rng)
    block = rng.choice([8, 16, 32])
    ref = _reference(seg, comp, block)
    ours = layout_block_mask(seg, comp, packed_mask_mod(seg, comp), block=block)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    # The listed blocks (the first `count` indices of each query block) are the same sets.
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        counts = getattr(ref, num)[0, 0]
        for q, n in enumerate(counts.tolist()):
            assert sorted(getattr(ours, idx)[0, 0, q, :n].tolist()) == sorted(getattr(ref, idx)[0, 0, q, :n].tolist())


def test_block_states_match_the_dense_rule() -> None:
    """Every block pair: full iff all its token pairs are allowed, partial iff some but not all."""
    seg, comp = _row(random.Random(99))
    t, block = seg.numel(), 16
    mm = packed_mask_mod(seg, comp)
    dense = mm(None, None, torch.arange(t)[:, None], torch.arange(t)[None, :])
    partial, full = block_states(seg, comp, mm, block=block)
    nb = -(-t // block)
    for qb in range(nb):
        for kb in range(nb):
            part = torch.zeros(block, block, dtype=torch.bool)  # past the row end: masked
            real = dense[qb * block:(qb + 1) * block, kb * block:(kb + 1) * block]
            part[:real.shape[0], :real.shape[1]] = real
            assert bool(full[qb, kb]) == bool(part.all()), (qb, kb)
            assert bool(partial[qb, kb]) == bool(part.any() and not part.all()), (qb, kb)


def test_flex_block_mask_uses_the_layout() -> None:
    seg, comp = _row(random.Random(5))
    ref = _reference(seg, comp, 128)
    assert torch.equal(flex_block_mask(seg, comp).to_dense(), ref.to_dense())
