"""CUDA paths that have no CPU counterpart to test against (skipped without a GPU).

bench/gpu_check.sh runs these with the rest of the suite on a GPU machine."""

from __future__ import annotations

import pytest
import torch

from sleuth.records import Completion, Group, Problem, SamplingParams
from sleuth.rollout.base import GenerationRequest
from sleuth.rollout.hf_engine import HFEngine
from sleuth.system.attention import PACKED, register_packed_attention
from sleuth.testing.tiny_model import build_model, build_tokenizer
from sleuth.train.kernels.block_mask import layout_block_mask
from sleuth.train.kernels.packed_attention import packed_mask_mod
from sleuth.train.packing import pack_groups

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_graph_decoding_equals_the_growing_cache():
    register_packed_attention()
    model = build_model(hidden=64, layers=2).to("cuda").eval()
    model.set_attn_implementation(PACKED)
    reqs = [GenerationRequest([(s + 7 * i) % 250 for i in range(plen)], n,
                              SamplingParams(max_tokens=24, seed=s, stop=("a",) if s == 1 else ()), f"r{s}")
            for s, n, plen in ((1, 8, 40), (2, 6, 25), (3, 3, 7))]
    out = {}
    for mode in ("dynamic", "cuda_graphs"):
        engine = HFEngine(model, build_tokenizer(), decode=mode)
        out[mode] = engine.generate_all(reqs)
        engine.close()
    for ra, rb in zip(out["dynamic"], out["cuda_graphs"], strict=True):
        for x, y in zip(ra.samples, rb.samples, strict=True):
            assert x.token_ids == y.token_ids
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


def test_layout_block_mask_on_cuda_equals_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    groups = []
    for g in range(3):  # Clue-shaped: 1,000-token prompts, 8 completions of 200
        prompt = [g + 1] * 1000
        comps = [Completion(prompt, [10 + 8 * g + i] * 200, [0.0] * 200, "length", "") for i in range(8)]
        groups.append(Group(Problem(f"g{g}", [], None), prompt, comps, [0.0] * 8))
    (row,) = pack_groups(groups, 8192, pad_to_multiple=128).rows
    assert row.length > row.n_real_tokens  # padding at the end
    scope_end = row.scope_end.to("cuda")
    mm = packed_mask_mod(scope_end)
    t = scope_end.numel()
    ref = create_block_mask(mm, None, None, t, t, device="cuda")
    ours = layout_block_mask(scope_end, mm)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
