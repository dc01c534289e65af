"""Fixed-shape decode steps (static_decode.py) give the growing-cache engine's samples exactly."""

from __future__ import annotations

import pytest
import torch

from sleuth.config import RolloutConfig
from sleuth.errors import UserError
from sleuth.records import SamplingParams
from sleuth.rollout.base import GenerationRequest
from sleuth.rollout.factory import make_engine
from sleuth.rollout.static_decode import StaticSharedCache
from sleuth.testing.tiny_model import write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def _requests() -> list[GenerationRequest]:
    def req(n: int, max_tokens: int, seed: int, plen: int, **kw) -> GenerationRequest:
        ids = [(seed + 7 * i) % 250 for i in range(plen)]
        return GenerationRequest(ids, n, SamplingParams(max_tokens=max_tokens, seed=seed, **kw), f"r{seed}")

    # Left padding (different prompt lengths), rows ending at different steps (stop strings), and
    # different completion budgets in one batch.
    return [req(8, 20, 1, 40, stop=("a", "e")), req(6, 24, 2, 25), req(3, 9, 3, 7, temperature=0.0)]


@pytest.mark.parametrize("mode", ["static", "cuda_graphs"])
def test_static_decoding_equals_dynamic(model_dir, mode):
    """Same tokens, finish reasons and logprobs (1e-5) as the growing cache; cuda_graphs runs the
    same steps eagerly where there is no CUDA."""
    dynamic = make_engine(RolloutConfig(engine="hf", hf_decode="dynamic"), str(model_dir), "float32", seed=0)
    static = make_engine(RolloutConfig(engine="hf", hf_decode=mode), str(model_dir), "float32", seed=0)
    a, b = dynamic.generate_all(_requests()), static.generate_all(_requests())
    dynamic.close()
    static.close()
    lengths = set()
    for ra, rb in zip(a, b, strict=True):
        for x, y in zip(ra.samples, rb.samples, strict=True):
            assert x.token_ids == y.token_ids
            assert x.finish_reason == y.finish_reason
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
            lengths.add(len(x.token_ids))
    assert len(lengths) > 2  # rows really finished at different steps (the batch was compacted)


def test_static_cache_counts_steps_on_the_device():
    """The step counter and the slot mask live in tensors: one update per layer advances them once."""
    layers, g, hkv, w, d = 3, 2, 2, 5, 4
    prefix = [(torch.randn(g, hkv, w, d), torch.randn(g, hkv, w, d)) for _ in range(layers)]
    cache = StaticSharedCache(prefix, torch.ones(g, w), [3, 1], max_new=6)
    for step in range(2):
        for layer in range(layers):
            k, _ = cache.update(torch.full((4, hkv, 1, d), float(step + 1)), torch.zeros(4, hkv, 1, d), layer)
            assert k.shape == (4, hkv, 6, d)  # always the full budget of slots
        assert int(cache.step) == step + 1
    assert torch.equal(cache.own_bias[:2], torch.zeros(2)) and torch.isinf(cache.own_bias[2:]).all()
    assert torch.equal(cache.own_k[0][:, :, 1], torch.full((4, hkv, d), 2.0))


def test_bad_decode_mode_and_unsupported_attention(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sleuth.rollout.hf_engine import HFEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    with pytest.raises(UserError, match="hf_decode='fast'"):
        HFEngine(model, tok, decode="fast")
    eager = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    with pytest.raises(UserError, match="needs shared-prompt decoding, which this model cannot use"):
        HFEngine(eager, tok, decode="static")
