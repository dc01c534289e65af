import random

import pytest
import torch

from sleuth.errors import UserError
from sleuth.records import Completion, Group, Problem
from sleuth.train.packing import MIN_SHARED, pack_groups


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
    # The prompt is seen by the whole tree, each completion's tokens by the completion only.
    assert row.scope_end.tolist() == [8, 8, 8, 5, 5, 8, 8, 8]
    assert [(n.start, n.length, n.parent) for n in row.nodes] == [(0, 3, -1), (3, 2, 0), (5, 3, 0)]
    # The first token of each completion is predicted by the last prompt token (position 2).
    assert row.predictor_index.tolist() == [2, 3, 2, 5, 6]
    assert row.target_ids.tolist() == [100, 101, 110, 111, 112]
    assert row.token_seq.tolist() == [0, 0, 1, 1, 1]
    assert row.advantages.tolist() == [1.0, 1.0, 2.0, 2.0, 2.0]
    assert row.engine_logprobs.tolist() == [-0.5, -1.5, -0.5, -1.5, -2.5]
    assert batch.seq_lengths.tolist() == [2, 3]
    assert batch.n_tokens == 8 and batch.n_completion_tokens == 5


def test_token_bitmasks_follow_the_targets() -> None:
    """Completion.token_bitmask rows reach the row in target order (loss-masked tokens left out);
    a completion without one allows every token; rows without any carry none."""
    g = make_group([1, 2, 3], [2, 3])
    assert pack_groups([g], row_tokens=100).rows[0].token_bitmask is None
    g.completions[1].token_bitmask = torch.arange(6, dtype=torch.int32).reshape(3, 2)
    g.completions[1].loss_mask = [1, 0, 1]
    (row,) = pack_groups([g], row_tokens=100).rows
    assert row.target_ids.tolist() == [100, 101, 110, 112]
    assert row.token_bitmask.tolist() == [[-1, -1], [-1, -1], [0, 1], [4, 5]]
    g.completions[1].token_bitmask = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(UserError, match="completion 1 has a token_bitmask that is not an int32 tensor of 3 rows"):
        pack_groups([g], row_tokens=100)


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
            assert row.input_ids[list(pl.positions)].tolist() == g.prompt_ids + g.completions[pl.completion].completion_ids
            assert row.position_ids[list(pl.positions)].tolist() == list(range(len(pl.positions)))
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
    g.completions[0].loss_mask = [1]
    with pytest.raises(UserError, match="completion 0 has a loss_mask of 1 entries for 2 tokens"):
        pack_groups([g], 10)
    g.completions[0].loss_mask = [0, 0]
    with pytest.raises(UserError, match="completion 0 has no sampled token"):
        pack_groups([g], 10)
    g.completions[0].loss_mask = [1, 2]
    with pytest.raises(UserError, match="other than 0 or 1"):
        pack_groups([g], 10)
    g = make_group([1], [2])
    g.advantages = [1.0, 2.0]
    with pytest.raises(UserError, match="2 advantages for 1 completions"):
        pack_groups([g], 10)


def turns(*spans: tuple[list[int], int]) -> tuple[list[int], list[int]]:
    """(completion_ids, loss_mask) from (tokens, sampled?) spans of a multi-turn trajectory."""
    return [t for ids, _ in spans for t in ids], [m for ids, m in spans for _ in ids]


def tree_group(prompt: list[int], trajectories: list[tuple[list[int], list[int]]],
               prompts: list[list[int]] | None = None) -> Group:
    comps = []
    for i, (ids, mask) in enumerate(trajectories):
        own = prompts[i] if prompts else prompt
        comps.append(Completion(own, ids, [-0.1 * (k + 1) if m else 0.0 for k, m in enumerate(mask)], "stop", "",
                                loss_mask=mask))
    return Group(Problem("episodes", [], None), prompt, comps, [float(i + 1) for i in range(len(comps))])


R1, TOOL, R2a, R2b = list(range(100, 120)), list(range(200, 230)), [7, 8], list(range(300, 320))


def test_multi_turn_tree_layout_masks_and_targets() -> None:
    # Two episodes share their first reply and tool result, then diverge; a third diverges at once.
    prompt = [1, 2, 3]
    trajs = [turns((R1, 1), (TOOL, 0), (R2a, 1)), turns((R1, 1), (TOOL, 0), (R2b, 1)),
             turns((list(range(400, 420)), 1))]
    batch = pack_groups([tree_group(prompt, trajs)], row_tokens=1000)
    (row,) = batch.rows
    # Root = prompt; its leaf child (episode 3) first, then the shared turns with their two leaves.
    assert [(n.start, n.length, n.parent) for n in row.nodes] == [
        (0, 3, -1), (3, 20, 0), (23, 50, 0), (73, 2, 2), (75, 20, 2)]
    assert batch.n_tokens == row.length == 95  # vs 3 x 3 + 72 + 90 + 20 unshared
    assert row.scope_end.tolist() == [95] * 3 + [23] * 20 + [95] * 50 + [75] * 2 + [95] * 20
    for pl, (ids, mask) in zip(row.placements, trajs, strict=True):
        seq = prompt + ids
        assert row.input_ids[list(pl.positions)].tolist() == seq
        assert row.position_ids[list(pl.positions)].tolist() == list(range(len(seq)))
        assert pl.n_targets == sum(mask) and pl.prompt_len == 3
    assert [pl.depth for pl in row.placements] == [3, 3, 2]
    # Targets: sampled tokens only, the shared first reply once per episode; no tool tokens.
    assert batch.seq_lengths.tolist() == [22, 40, 20]
    assert row.target_ids.tolist() == R1 + R2a + R1 + R2b + list(range(400, 420))
    assert not set(TOOL) & set(row.target_ids.tolist())
    # The second reply is predicted by the tool result's last token; episode 2's first by the prompt.
    first, second = row.placements[0], row.placements[1]
    assert row.predictor_index[20].item() == first.positions[3 + 20 + 30 - 1] == 72
    assert row.predictor_index[22].item() == row.predictor_index[0].item() == 2
    assert row.engine_logprobs[20].item() == pytest.approx(-0.1 * 51)
    assert row.token_seq.tolist() == [0] * 22 + [1] * 40 + [2] * 20
    assert row.advantages.tolist() == [1.0] * 22 + [2.0] * 40 + [3.0] * 20
    assert second.positions[: 3 + 50] == first.positions[: 3 + 50]


def test_short_shared_spans_are_repeated_and_distinct_prompts_get_their_own_trees() -> None:
    prompt = [1, 2, 3]
    short = [5, 6, 7]  # shared by two episodes only, fewer than MIN_SHARED tokens
    assert len(short) < MIN_SHARED
    trajs = [turns(([*short, 8], 1)), turns(([*short, 9, 9], 1)), turns(([4], 1)),
             turns(([60, 61], 1)), turns(([60, 62], 1))]
    own = [prompt, prompt, prompt, [50] * 20, [50] * 19 + [51]]  # calls with their own prompts
    (row,) = pack_groups([tree_group(prompt, trajs, own)], 1000).rows
    # Tree 0: the prompt with three leaves; tree 1: 19 shared tokens with two 3-token branches.
    assert [(n.start, n.length, n.parent) for n in row.nodes] == [
        (0, 3, -1), (3, 4, 0), (7, 5, 0), (12, 1, 0), (13, 19, -1), (32, 3, 4), (35, 3, 4)]
    assert row.segment_ids.tolist() == [0] * 13 + [1] * 25
    for pl in row.placements:
        assert row.input_ids[list(pl.positions)].tolist() == own[pl.completion] + trajs[pl.completion][0]


def test_tree_group_split_across_rows_keeps_sharing_within_parts() -> None:
    prompt = list(range(1, 31))
    shared = list(range(100, 140))
    trajs = [turns((shared, 1), ([500 + 10 * i + k for k in range(30)], 1)) for i in range(4)]
    group = tree_group(prompt, trajs)
    batch = pack_groups([group], row_tokens=150)
    # Each part holds prompt + shared turn (70) + two 30-token branches: 130 tokens.
    assert [r.n_real_tokens for r in batch.rows] == [130, 130]
    assert batch.n_tokens == 260
    seen = sorted(pl.seq for r in batch.rows for pl in r.placements)
    assert seen == [0, 1, 2, 3]
    for row in batch.rows:
        for pl in row.placements:
            assert row.input_ids[list(pl.positions)].tolist() == prompt + trajs[pl.completion][0]
    one_row = pack_groups([group], row_tokens=1000)
    assert one_row.n_tokens == 70 + 4 * 30 and len(one_row.rows) == 1
