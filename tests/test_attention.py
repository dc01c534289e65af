import pytest
import torch

from sleuth.records import Completion, Group, Problem
from sleuth.system.attention import PACKED, dense_mask, register_packed_attention
from sleuth.testing.tiny_model import build_model
from sleuth.train.kernels.packed_attention import attention_kwargs, backend_for, packed_mask_mod
from sleuth.train.packing import pack_groups


def tree_groups() -> list[Group]:
    """A branching multi-turn group (three levels below the prompt) and a group of two prompts."""
    prompt = [5, 6, 7]
    turn1, tool = list(range(20, 40)), list(range(60, 80))
    turn2 = list(range(90, 110))
    trajs = [turn1 + tool + turn2 + [1, 2], turn1 + tool + turn2 + [3], turn1 + tool + [4, 4, 4], [*turn1, 8],
             [9, 9]]
    comps = [Completion(prompt, t, [0.0] * len(t), "stop", "", loss_mask=[1] * len(t)) for t in trajs]
    first = Group(Problem("tree", [], None), prompt, comps, [1.0] * len(comps))
    other = [11] * 18
    comps = [Completion(p, c, [0.0] * len(c), "stop", "") for p, c in
             ((prompt, [30, 31]), ([*other, 12], [40]), ([*other, 13], [41, 42]))]
    return [first, Group(Problem("prompts", [], None), prompt, comps, [1.0] * 3)]


def test_dense_mask_rule() -> None:
    # [prompt p0 p1 | a0 a1 | b0 ] [prompt q0 | c0] [pad]
    scope_end = torch.tensor([5, 5, 4, 4, 5, 7, 7, 8])
    m = dense_mask(scope_end)[0, 0]
    allowed = {(i, j) for i in range(8) for j in range(8) if bool(m[i, j])}
    expected = {(0, 0), (1, 0), (1, 1),
                (2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (3, 2), (3, 3),
                (4, 0), (4, 1), (4, 4),
                (5, 5), (6, 5), (6, 6), (7, 7)}
    assert allowed == expected
    assert m.dtype == torch.bool and dense_mask(scope_end).shape == (1, 1, 8, 8)


def test_tree_mask_is_the_union_of_each_sequence_causal_mask() -> None:
    (row,) = pack_groups(tree_groups(), 1000, pad_to_multiple=16).rows
    assert max(pl.depth for pl in row.placements) == 5 and row.length > row.n_real_tokens
    expected = torch.zeros(row.length, row.length, dtype=torch.bool)
    for pl in row.placements:
        pos = torch.tensor(pl.positions)
        expected[pos[:, None], pos[None, :]] = torch.ones(len(pos), len(pos), dtype=torch.bool).tril()
    pad = torch.arange(row.n_real_tokens, row.length)
    expected[pad, pad] = True
    assert torch.equal(dense_mask(row.scope_end)[0, 0], expected)
    # The CUDA BlockMask is built from this mask_mod; evaluate it on the full index grid.
    q, kv = torch.arange(row.length)[:, None], torch.arange(row.length)[None, :]
    assert torch.equal(packed_mask_mod(row.scope_end)(0, 0, q, kv), expected)


def test_backend_selection() -> None:
    assert backend_for("cpu") == PACKED
    assert backend_for(torch.device("cuda", 0)) == "flex_attention"


def test_sdpa_llama_with_packed_mask_matches_separate_sequences() -> None:
    model = build_model(hidden=32, layers=2, heads=4, kv_heads=2, seed=1).eval()
    model.set_attn_implementation("sdpa")
    prompt = [5, 6, 7, 8]
    comps = [[20, 21, 22], [30], [40, 41]]
    group = Group(Problem("p", [], None), prompt,
                  [Completion(prompt, c, [0.0] * len(c), "stop", "") for c in comps], [1.0, 1.0, 1.0])
    (row,) = pack_groups([group], 64).rows
    with torch.no_grad():
        packed = model(input_ids=row.input_ids[None], position_ids=row.position_ids[None],
                       attention_mask=dense_mask(row.scope_end)).logits[0]
        for pl, c in zip(row.placements, comps):
            alone = model(input_ids=torch.tensor([prompt + c])).logits[0]
            torch.testing.assert_close(packed[list(pl.positions)], alone, rtol=1e-5, atol=1e-5)


LONG_PROMPT = list(range(50, 62))


@pytest.mark.parametrize("layout", ["short_prompts", "batched_completions", "trees"])
def test_packed_attention_equals_dense_mask_forward_and_backward(layout: str) -> None:
    register_packed_attention()
    if layout == "trees":
        specs = []
        budget, length, real = 1000, 104, 100
    elif layout == "short_prompts":
        specs = [([5, 6, 7], [[20, 21], [30, 31, 32, 33]]), ([9] * 5, [[40], [41, 42]])]
        budget, length, real = 64, 24, 17
    else:  # unequal completions of one long prompt: batched in length buckets, padded, reordered
        specs = [(LONG_PROMPT, [[20, 21, 22, 23], [30, 31, 32, 33, 34], [35, 36, 37, 38, 39], [24, 25, 26], [40]])]
        budget, length, real = 64, 32, 30
    groups = tree_groups() if layout == "trees" else []
    for g, (prompt, comps) in enumerate(specs):
        groups.append(Group(Problem(f"p{g}", [], None), prompt,
                            [Completion(prompt, c, [0.0] * len(c), "stop", "") for c in comps], [1.0] * len(comps)))
    (row,) = pack_groups(groups, budget, pad_to_multiple=8).rows
    assert row.length == length and row.n_real_tokens == real
    results = []
    for impl in ("sdpa", PACKED):
        model = build_model(hidden=32, layers=2, heads=4, kv_heads=2, seed=3)
        model.set_attn_implementation(impl)
        hidden = model.model(input_ids=row.input_ids[None], position_ids=row.position_ids[None],
                             **attention_kwargs(row, impl, torch.device("cpu"))).last_hidden_state[0]
        real = hidden[: row.n_real_tokens]
        (real * torch.linspace(-1, 1, real.numel()).view_as(real)).sum().backward()
        results.append((real.detach(), [p.grad.clone() for p in model.model.parameters()]))
    (h_dense, g_dense), (h_packed, g_packed) = results
    torch.testing.assert_close(h_packed, h_dense, rtol=1e-5, atol=1e-6)
    if layout == "trees":  # and both equal each sequence computed alone
        model = build_model(hidden=32, layers=2, heads=4, kv_heads=2, seed=3)
        for pl in row.placements:
            comp = groups[pl.group].completions[pl.completion]
            alone = model.model(input_ids=torch.tensor([comp.prompt_ids + comp.completion_ids])).last_hidden_state[0]
            torch.testing.assert_close(h_packed[list(pl.positions)], alone.detach(), rtol=1e-5, atol=1e-5)
    for a, b in zip(g_packed, g_dense, strict=True):  # 1e-5 relative, as the trainer's equality tests
        assert float((a - b).norm()) <= 1e-5 * float(b.norm()) + 1e-9
    # Without a layout the packed implementation is plain sdpa (e.g. for generation).
    model = build_model(hidden=32, layers=2, heads=4, kv_heads=2, seed=3).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        model.set_attn_implementation(PACKED)
        torch.testing.assert_close(model(input_ids=ids).logits, plain)


def test_dropout_falls_back_to_the_dense_mask() -> None:
    from sleuth.system.attention import packed_attention_forward
    from sleuth.train.kernels.packed_attention import row_layout

    prompt = [5, 6, 7]
    group = Group(Problem("p", [], None), prompt,
                  [Completion(prompt, c, [0.0] * len(c), "stop", "") for c in ([8, 9], [10])], [1.0, -1.0])
    (row,) = pack_groups([group], 16, pad_to_multiple=8).rows
    layout = row_layout(row)
    q, k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    torch.manual_seed(7)
    got, _ = packed_attention_forward(module, q, k, v, None, dropout=0.5, packed_layout=layout)
    torch.manual_seed(7)
    mask = dense_mask(row.scope_end)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            attn_mask=mask, dropout_p=0.5)
    torch.testing.assert_close(got, want.transpose(1, 2))
