"""A full weight sync into vLLM on CPU reaches a tied output head (vllm_weights.repack_cpu_kernels).

Its own module: the test starts a vLLM engine of its own, which must be the only one alive in the
process when it is closed (closing one tears down vLLM's process-wide parallel state), so it cannot
sit beside test_rollout_engines.py's module-wide engines.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sleuth.config import RolloutConfig
from sleuth.rollout.factory import make_engine
from test_rollout_engines import CONTEXT, LOGPROB_TOL, forward_logprobs, req

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_a_tied_output_head_follows_a_full_sync_into_vllm(tmp_path):
    """A tied head is never loaded by name (its weight is the token embedding's): vLLM's CPU matmul
    for it was prepacked from the old table and must be packed again after the reload
    (vllm_weights.repack_cpu_kernels); else logits come from the old table while the trainer's
    come from the new one (SmolLM2, tied, 0.17 nats off after a warm start, on an AVX2-only CPU)."""
    from transformers import AutoModelForCausalLM

    from sleuth.testing.tiny_model import write_tiny_model

    # SmolLM2's width: oneDNN packs a table this wide into a layout of its own (a tiny one it reads in place)
    folder = write_tiny_model(tmp_path / "tied", hidden=576, layers=1, heads=9, kv_heads=3, tied=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = RolloutConfig(engine="vllm", max_model_len=CONTEXT, kv_cache_gb=0.002, timeout_s=120)
    engine = make_engine(cfg, str(folder), "float32", seed=0)
    try:
        request = req(2, 12, seed=3)
        with torch.no_grad():  # a new table (the trainer's after a warm start): the tied head follows it
            table = model.model.embed_tokens.weight
            table.add_(0.5 * torch.randn(table.shape, generator=torch.Generator().manual_seed(0)))
        assert model.lm_head.weight is table or model.lm_head.weight.data_ptr() == table.data_ptr()
        engine.sync_weights([(n, p.detach().clone()) for n, p in model.named_parameters() if n != "lm_head.weight"])
        for sample in engine.generate_all([request])[0].samples:
            want = forward_logprobs(model, request.prompt_ids, list(sample.token_ids))
            assert torch.allclose(torch.tensor(sample.logprobs), want, atol=LOGPROB_TOL), (sample.logprobs[:3], want[:3])
    finally:
        engine.close()
