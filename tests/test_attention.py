import pytest
import torch

from sleuth.records import Completion, Group, Problem
from sleuth.testing.tiny_model import build_model
from sleuth.train.attention import (
    PACKED,
    attention_kwargs,
    backend_for,
    dense_mask,
    packed_mask_mod,
    register_packed_attention,
)
from sleuth.train.packing import pack_groups


def test_dense_mask_rule() -> None:
    # [prompt p0 p1 | a0 a1 | b0 ] [prompt q0 | c0] [pad]
    seg = torch.tensor([0, 0, 0, 0, 0, 1, 1, -1])
    comp = torch.tensor([0, 0, 1, 1, 2, 0, 3, 0])
    m = dense_mask(seg, comp)[0, 0]
    allowed = {(i, j) for i in range(8) for j in range(8) if bool(m[i, j])}
    expected = {(0, 0), (1, 0), (1, 1),
                (2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (3, 2), (3, 3),
                (4, 0), (4, 1), (4, 4),
                (5, 5), (6, 5), (6, 6), (7, 7)}
    assert allowed == expected
    assert m.dtype == torch.bool and dense_mask(seg, comp).shape == (1, 1, 8, 8)


def test_flex_mask_mod_follows_the_same_rule() -> None:
    # The CUDA BlockMask is built from this mask_mod; evaluate it on the full index grid.
    seg = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, -1, -1])
    comp = torch.tensor([0, 0, 1, 1, 2, 0, 3, 3, 0, 0])
    q = torch.arange(10)[:, None]
    kv = torch.arange(10)[None, :]
    got = packed_mask_mod(seg, comp)(0, 0, q, kv)
    assert torch.equal(got, dense_mask(seg, comp)[0, 0])


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
                       attention_mask=dense_mask(row.segment_ids, row.completion_ids)).logits[0]
        for pl, c in zip(row.placements, comps):
            alone = model(input_ids=torch.tensor([prompt + c])).logits[0]
            torch.testing.assert_close(packed[pl.start : pl.start + pl.length], alone[len(prompt):],
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(packed[: len(prompt)], alone[: len(prompt)], rtol=1e-5, atol=1e-5)


LONG_PROMPT = list(range(50, 62))


@pytest.mark.parametrize("layout", ["short_prompts", "batched_completions"])
def test_packed_attention_equals_dense_mask_forward_and_backward(layout: str) -> None:
    register_packed_attention()
    if layout == "short_prompts":
        specs = [([5, 6, 7], [[20, 21], [30, 31, 32, 33]]), ([9] * 5, [[40], [41, 42]])]
        budget, length, real = 64, 24, 17
    else:  # unequal completions of one long prompt: batched in length buckets, padded, reordered
        specs = [(LONG_PROMPT, [[20, 21, 22, 23], [30, 31, 32, 33, 34], [35, 36, 37, 38, 39], [24, 25, 26], [40]])]
        budget, length, real = 64, 32, 30
    groups = []
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
    from sleuth.train.attention import packed_attention_forward, row_layout

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
    mask = dense_mask(row.segment_ids, row.completion_ids)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            attn_mask=mask, dropout_p=0.5)
    torch.testing.assert_close(got, want.transpose(1, 2))
