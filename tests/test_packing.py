import random

import pytest
import torch

from sleuth.errors import UserError
from sleuth.records import Completion, Group, Problem
from sleuth.train.packing import pack_groups


def make_group(prompt: list[int], lengths: list[int], name: str = "p", start: int = 100) -> Group:
    comps = []
    for i, n in enumerate(lengths):
        ids = [start + 10 * i + k for k in range(n)]
        comps.append(Completion(prompt, ids, [-0.5 - k for k in range(n)], "stop", ""))
    return Group(Problem(name, [], None), prompt, comps, [float(i + 1) for i in range(len(lengths))])


def test_row_layout_positions_and_targets() -> None:
    g = make_group([1, 2, 3], [2, 3])
    batch = pack_groups([g], row_tokens=100)
    (row,) = batch.rows
    assert row.input_ids.tolist() == [1, 2, 3, 100, 101, 110, 111, 112]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 4, 5]
    assert row.segment_ids.tolist() == [0] * 8
    assert row.completion_ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    # The first token of each completion is predicted by the last prompt token (position 2).
    assert row.predictor_index.tolist() == [2, 3, 2, 5, 6]
    assert row.target_ids.tolist() == [100, 101, 110, 111, 112]
    assert row.token_seq.tolist() == [0, 0, 1, 1, 1]
    assert row.advantages.tolist() == [1.0, 1.0, 2.0, 2.0, 2.0]
    assert row.engine_logprobs.tolist() == [-0.5, -1.5, -0.5, -1.5, -2.5]
    assert batch.seq_lengths.tolist() == [2, 3]
    assert batch.n_tokens == 8 and batch.n_completion_tokens == 5


def test_groups_share_rows_and_large_groups_split() -> None:
    small = [make_group([1], [1], f"s{i}") for i in range(3)]  # 2 tokens each
    big = make_group([7, 7, 7, 7], [5, 5, 5, 5], "big")  # 24 tokens: split, prompt repeated
    batch = pack_groups([*small, big], row_tokens=16)
    assert all(r.length <= 16 for r in batch.rows)
    # Every completion appears exactly once; every part starts with its full prompt.
    seqs = sorted(pl.seq for r in batch.rows for pl in r.placements)
    assert seqs == list(range(7))
    for row in batch.rows:
        for pl in row.placements:
            g = [*small, big][pl.group]
            prompt = row.input_ids[pl.prompt_start : pl.prompt_start + pl.prompt_len].tolist()
            assert prompt == g.prompt_ids
            got = row.input_ids[pl.start : pl.start + pl.length].tolist()
            assert got == g.completions[pl.completion].completion_ids
    big_rows = [r for r in batch.rows if any(pl.group == 3 for pl in r.placements)]
    assert len(big_rows) == 2
    # First-fit decreasing: 2 big parts (14 each) then the small groups (2 each) fill the gaps.
    assert [r.length for r in batch.rows] == [16, 16, 2]


def test_oversized_completion_gets_its_own_row_and_padding() -> None:
    g = make_group([1, 2, 3], [20, 1])
    batch = pack_groups([g], row_tokens=10, pad_to_multiple=8)
    lengths = sorted(r.n_real_tokens for r in batch.rows)
    assert lengths == [4, 23]
    for row in batch.rows:
        assert row.length % 8 == 0
        pad = row.segment_ids == -1
        assert int(pad.sum()) == row.length - row.n_real_tokens
        assert bool(pad[row.n_real_tokens :].all())  # padding only at the row end


def test_random_packing_keeps_every_token_once() -> None:
    rng = random.Random(0)
    groups = [make_group([rng.randrange(50) for _ in range(rng.randint(1, 12))],
                         [rng.randint(1, 15) for _ in range(rng.randint(1, 6))], f"g{i}", 1000 * i)
              for i in range(12)]
    batch = pack_groups(groups, row_tokens=40)
    assert int(sum(r.target_ids.numel() for r in batch.rows)) == batch.n_completion_tokens
    all_targets = torch.cat([r.target_ids for r in batch.rows]).sort().values
    expected = torch.tensor(sorted(t for g in groups for c in g.completions for t in c.completion_ids))
    assert torch.equal(all_targets, expected)
    assert max(r.length for r in batch.rows) <= 40


def test_invalid_groups() -> None:
    g = make_group([1], [2])
    g.advantages = None
    with pytest.raises(UserError, match="no advantages"):
        pack_groups([g], 10)
    g = make_group([], [2])
    with pytest.raises(UserError, match="empty prompt"):
        pack_groups([g], 10)
    g = make_group([1], [2, 3])
    g.completions[1].completion_ids = []
    g.completions[1].logprobs = []
    with pytest.raises(UserError, match="completion 1 has no tokens"):
        pack_groups([g], 10)
    g = make_group([1], [2])
    g.completions[0].prompt_ids = [9]
    with pytest.raises(UserError, match="different prompt"):
        pack_groups([g], 10)
    g = make_group([1], [2])
    g.advantages = [1.0, 2.0]
    with pytest.raises(UserError, match="2 advantages for 1 completions"):
        pack_groups([g], 10)
