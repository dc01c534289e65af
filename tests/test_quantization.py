"""LoRA on a bitsandbytes-quantized base (model.quantization = int8 | nf4), on the tiny model.

The base's linear layers are quantized at load and frozen; the adapter trains in float32 on top.
Merged weights (weight sync, export) are the dequantized base plus the adapter's delta, so a plain
float32 model loaded with them computes what the quantized policy computes.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from sleuth.config import AlgorithmConfig, LoraConfig, ModelConfig, TrainerConfig
from sleuth.errors import UserError
from sleuth.records import Completion, Group, Problem
from sleuth.testing.tiny_model import write_tiny_model
from sleuth.train.policy import Policy
from sleuth.train.step import Trainer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                reason="bitsandbytes is not installed (the quant extra)")
QUANT_TOL = 1e-4
"""Max abs logit difference between the quantized policy and a float32 model holding its
dequantized merged weights (the same numbers, multiplied in a different order)."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=128)


def quantized_policy(folder: Path, quantization: str) -> Policy:
    cfg = ModelConfig(path=str(folder), dtype="float32", quantization=quantization,
                      lora=LoraConfig(rank=4, alpha=8.0))
    policy = Policy.from_config(cfg, need_reference=True, device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return policy


def plain_model(folder: Path, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=True)
    return model


def groups(seed: int) -> list[Group]:
    rng = random.Random(seed)
    out = []
    for g in range(2):
        prompt = [rng.randrange(256) for _ in range(rng.randint(6, 12))]
        comps = [Completion(prompt, ids, [-5.0] * len(ids), "stop", "", reward=0.0)
                 for ids in ([rng.randrange(256) for _ in range(rng.randint(4, 10))] for _ in range(3))]
        out.append(Group(Problem(f"p{g}", [], None), prompt, comps, [1.0, -0.5, -0.5]))
    return out


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_quantized_base_trains_an_adapter(tiny_dir: Path, quantization: str, tmp_path: Path) -> None:
    import bitsandbytes as bnb

    policy = quantized_policy(tiny_dir, quantization)
    lm = policy.causal_lm
    layer_type = bnb.nn.Linear4bit if quantization == "nf4" else bnb.nn.Linear8bitLt
    q_proj = lm.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, layer_type)
    assert not policy.adapter_is_portable  # the engine's base is not quantized: sync merged weights
    trainable = dict(policy.model.named_parameters())
    assert all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items() if p.requires_grad)

    ids = torch.tensor([list(range(30, 70))])
    with torch.no_grad():
        adapted = lm(input_ids=ids).logits
        merged = dict(policy.sync_state())
        assert all(t.dtype == torch.float32 for t in merged.values())
        assert torch.allclose(plain_model(tiny_dir, merged)(input_ids=ids).logits, adapted, atol=QUANT_TOL, rtol=0)
        # The reference (adapter off) is the quantized base alone: no second copy.
        with policy.reference() as ref:
            base = ref(input_ids=ids).logits
        assert not torch.allclose(base, adapted, atol=1e-3)

    # The packed self-check holds on the quantized base, and a step moves only the adapter.
    trainer = Trainer(policy, AlgorithmConfig(tis_cap=None), TrainerConfig(row_tokens=64, lr=0.01), max_tokens=16)
    frozen = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    metrics = trainer.step(groups(1))
    assert metrics["self_check_mean_diff"] < (1e-5 if quantization == "nf4" else 1e-3)
    assert all(torch.equal(frozen[n], p) for n, p in policy.model.named_parameters() if n in frozen)
    with torch.no_grad():
        assert not torch.allclose(lm(input_ids=ids).logits, adapted, atol=1e-4)

    # Export: dequantized merged weights, no quantization_config, loadable as plain float32.
    from transformers import AutoModelForCausalLM

    out = policy.export_merged(tmp_path / "export")
    assert "quantization_config" not in (out / "config.json").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, lm(input_ids=ids).logits, atol=QUANT_TOL, rtol=0)


def test_quantization_needs_lora(tiny_dir: Path) -> None:
    cfg = ModelConfig(path=str(tiny_dir), dtype="float32", quantization="nf4", lora=LoraConfig(enabled=False))
    with pytest.raises(UserError, match=r"model\.quantization=nf4 needs model\.lora\.enabled=true"):
        Policy.from_config(cfg, need_reference=False, device="cpu")


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tied"), hidden=128, tied=True)


def test_nf4_table_matches_bitsandbytes_nf4() -> None:
    """Our 4-bit embedding stores what bitsandbytes' NF4 (blocks of 64, no double quantization)
    stores: the same code book and block scales, so the same dequantized values."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    from sleuth.train.kernels.quantized_embedding import NF4Embedding

    weight = torch.randn(300, 192, generator=torch.Generator().manual_seed(3)) * 0.05
    ours = NF4Embedding(weight, torch.float32)
    packed, state = quantize_4bit(weight, blocksize=64, compress_statistics=False, quant_type="nf4")
    theirs = dequantize_4bit(packed, state).float()
    mismatched = (ours.dequantize() != theirs).float().mean().item()
    assert mismatched < 1e-3  # (a value exactly between two levels may round either way)
    torch.testing.assert_close(ours.dequantize(), theirs, atol=1e-3, rtol=0)
    ids = torch.tensor([[0, 299, 7], [7, 7, 150]])
    assert torch.equal(ours(ids), ours.dequantize()[ids])  # a lookup dequantizes only its rows
    assert ours.codes.nbytes == 300 * 192 // 2 and ours.absmax.numel() == 300 * 3


def test_nf4_quantizes_a_tied_embedding_and_its_head(tied_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from sleuth.train.kernels.quantized_embedding import NF4Embedding, TiedNF4Head

    policy = quantized_policy(tied_dir, "nf4")
    lm = policy.causal_lm
    assert isinstance(lm.get_input_embeddings(), NF4Embedding)
    assert isinstance(lm.get_output_embeddings(), TiedNF4Head)
    plain = AutoModelForCausalLM.from_pretrained(tied_dir, dtype=torch.float32)
    table = plain.get_input_embeddings().weight.numel()
    # the table's 4-bit codes and scales take 1/8 + 1/64 of its float32 bytes
    assert lm.get_input_embeddings().codes.nbytes + lm.get_input_embeddings().absmax.nbytes == table // 2 + table // 16
    assert lm.get_memory_footprint() < 0.4 * plain.get_memory_footprint()
    # --dry-run's memory plan (cluster/plan.py) counts the quantized base as it is loaded
    from sleuth.cluster.plan import ModelShape

    adapter = sum(p.numel() * p.element_size() for n, p in lm.named_parameters() if "lora_" in n)
    planned = ModelShape.from_folder(tied_dir).base_bytes(4, "nf4")
    assert planned == pytest.approx(lm.get_memory_footprint() - adapter, rel=0.03)

    ids = torch.tensor([list(range(30, 70))])
    with torch.no_grad():
        adapted = lm(input_ids=ids).logits
        merged = dict(policy.sync_state())
        assert "model.embed_tokens.weight" in merged and "lm_head.weight" not in merged  # tied
        tied_plain = AutoModelForCausalLM.from_pretrained(tied_dir, dtype=torch.float32).eval()
        missing, unexpected = tied_plain.load_state_dict(merged, strict=False)
        assert missing == ["lm_head.weight"] and not unexpected  # the head is the tied table
        want = tied_plain(input_ids=ids).logits
        assert torch.allclose(want, adapted, atol=QUANT_TOL, rtol=0)
        # the quantized table is close to the original one (NF4: at most ~14% of a block's absmax)
        err = (merged["model.embed_tokens.weight"] - plain.get_input_embeddings().weight).abs().max()
        assert 0 < err < 0.15 * plain.get_input_embeddings().weight.abs().max()

    trainer = Trainer(policy, AlgorithmConfig(tis_cap=None), TrainerConfig(row_tokens=64, lr=0.01), max_tokens=16)
    metrics = trainer.step(groups(2))
    assert metrics["self_check_mean_diff"] < 1e-5 and metrics["grad_norm"] > 0
    out = policy.export_merged(tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, lm(input_ids=ids).logits, atol=QUANT_TOL, rtol=0)


def test_nf4_weights_keep_their_layout_after_an_inference_forward(tiny_dir: Path) -> None:
    """bitsandbytes repacks 4-bit weights for an inference-only kernel on AVX512_BF16 CPUs after an
    eval-mode forward without gradients (no gradient through the layer afterwards, garbage merges);
    the policy turns that off, so the codes keep their shape and the merge stays exact."""
    import bitsandbytes as bnb

    policy = quantized_policy(tiny_dir, "nf4")
    layers = [m for m in policy.causal_lm.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)
    shapes = [tuple(m.weight.shape) for m in layers]
    ids = torch.tensor([list(range(30, 50))])
    policy.causal_lm.eval()
    with torch.no_grad():
        adapted = policy.causal_lm(input_ids=ids).logits
        assert [tuple(m.weight.shape) for m in layers] == shapes
        merged = dict(policy.sync_state())
        assert torch.allclose(plain_model(tiny_dir, merged)(input_ids=ids).logits, adapted, atol=QUANT_TOL, rtol=0)
