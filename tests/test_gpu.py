"""CUDA paths that have no CPU counterpart to test against (skipped without a GPU).

bench/gpu_check.sh runs these with the rest of the suite on a GPU machine."""

from __future__ import annotations

import pytest
import torch

from sleuth.records import SamplingParams
from sleuth.rollout.base import GenerationRequest
from sleuth.rollout.hf_engine import HFEngine
from sleuth.testing.tiny_model import build_model, build_tokenizer
from sleuth.train.attention import PACKED, packed_mask_mod, register_packed_attention
from sleuth.train.block_mask import layout_block_mask

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

    seg, comp, c = [], [], 1
    for g in range(3):  # Clue-shaped: 1,000-token prompts, 8 completions of 200
        seg += [g] * 1000
        comp += [0] * 1000
        for _ in range(8):
            seg += [g] * 200
            comp += [c] * 200
            c += 1
    seg_t, comp_t = torch.tensor(seg + [-1] * 64, device="cuda"), torch.tensor(comp + [0] * 64, device="cuda")
    mm = packed_mask_mod(seg_t, comp_t)
    t = seg_t.numel()
    ref = create_block_mask(mm, None, None, t, t, device="cuda")
    ours = layout_block_mask(seg_t, comp_t, mm)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
