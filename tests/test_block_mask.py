"""The layout-built BlockMask equals create_block_mask's, block for block (built on the CPU), for
single-turn and prefix-tree rows."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from sleuth.records import Completion, Group, Problem
from sleuth.train.kernels.block_mask import block_states, layout_block_mask
from sleuth.train.kernels.packed_attention import flex_block_mask, packed_mask_mod
from sleuth.train.packing import pack_groups


def _row(rng: random.Random) -> torch.Tensor:
    """scope_end of a random packed row: single-turn groups (prompts with completions of random
    lengths), a multi-turn group whose episodes share turns and then branch, then padding."""
    groups = []
    for g in range(rng.randint(1, 4)):
        prompt = [rng.randrange(1, 200) for _ in range(rng.randint(1, 90))]
        comps = [[rng.randrange(200, 400) for _ in range(rng.randint(1, 70))] for _ in range(rng.randint(1, 5))]
        groups.append(Group(Problem(f"g{g}", [], None), prompt,
                            [Completion(prompt, c, [0.0] * len(c), "stop", "") for c in comps], [0.0] * len(comps)))
    shared = [rng.randrange(400, 500) for _ in range(rng.randint(16, 60))]
    trajs = [shared + [rng.randrange(500, 600) for _ in range(rng.randint(1, 50))] for _ in range(rng.randint(2, 4))]
    trajs.append([rng.randrange(500, 600) for _ in range(rng.randint(1, 30))])
    prompt = [rng.randrange(1, 200) for _ in range(rng.randint(1, 40))]
    groups.append(Group(Problem("tree", [], None), prompt,
                        [Completion(prompt, t, [0.0] * len(t), "stop", "") for t in trajs], [0.0] * len(trajs)))
    (row,) = pack_groups(groups, 100_000, pad_to_multiple=rng.choice([1, 1, rng.randint(2, 40)])).rows
    return row.scope_end


def _reference(scope_end: torch.Tensor, block: int) -> Any:
    t = scope_end.numel()
    return create_block_mask(packed_mask_mod(scope_end), None, None, t, t, device="cpu", BLOCK_SIZE=block)


@pytest.mark.parametrize("seed", range(12))
def test_layout_block_mask_equals_create_block_mask(seed: int) -> None:
    rng = random.Random(seed)
    scope_end = _row(rng)
    block = rng.choice([8, 16, 32])
    ref = _reference(scope_end, block)
    ours = layout_block_mask(scope_end, packed_mask_mod(scope_end), block=block)
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
    scope_end = _row(random.Random(99))
    t, block = scope_end.numel(), 16
    mm = packed_mask_mod(scope_end)
    dense = mm(None, None, torch.arange(t)[:, None], torch.arange(t)[None, :])
    partial, full = block_states(scope_end, mm, block=block)
    nb = -(-t // block)
    for qb in range(nb):
        for kb in range(nb):
            part = torch.zeros(block, block, dtype=torch.bool)  # past the row end: masked
            real = dense[qb * block:(qb + 1) * block, kb * block:(kb + 1) * block]
            part[:real.shape[0], :real.shape[1]] = real
            assert bool(full[qb, kb]) == bool(part.all()), (qb, kb)
            assert bool(partial[qb, kb]) == bool(part.any() and not part.all()), (qb, kb)


def test_flex_block_mask_uses_the_layout() -> None:
    scope_end = _row(random.Random(5))
    ref = _reference(scope_end, 128)
    assert torch.equal(flex_block_mask(scope_end).to_dense(), ref.to_dense())
