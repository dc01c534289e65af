"""A tiny random-init decoder (Llama, or any architecture in ARCHITECTURES), byte-level vocabulary, ChatML.

For tests, smoke runs and benchmarks that must not depend on a real checkpoint:

    python -m sleuth.testing.tiny_model OUT_DIR [--hidden 64 --layers 2 --seed 0]

The tokenizer maps every byte to one token (256 ids) plus three special tokens, so any text
round-trips exactly and sequences stay short enough for CPU tests at the small sizes used there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer():  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Byte-level BPE with no merges: one token per byte, ids 0..255 in byte order after the
    # GPT-2 byte-to-unicode mapping, special tokens appended after.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=EOT, bos_token=None, unk_token=None
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _byte_of(ch: str) -> int:
    # Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


WINDOW = 24
"""Sliding window of the tiny windowed architectures: shorter than test rows, so a packed
attention that ignored it would be caught by the packed-vs-naive checks."""

_YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 256,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
"""YaRN with Llama 4's attention scaling by position, as Ministral 3 and Mistral 4 ship (16 = 4096 / 256)."""
_MLA = {"kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
        "v_head_dim": 32, "head_dim": 16, "num_key_value_heads": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
_LINEAR = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4}

ARCHITECTURES: dict[str, dict[str, Any]] = {
    # model_type -> extra config fields (beyond the shared sizes set in build_model)
    "llama": {},
    # vLLM's Qwen2 takes head_dim = hidden / heads, and its CPU kernels need at least 32 (64 = 2 x 32).
    "qwen2": {"num_attention_heads": 2, "num_key_value_heads": 1},
    "qwen3": {},
    "mistral": {"sliding_window": WINDOW},
    "gemma3_text": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                    "query_pre_attn_scalar": 32},
    "phi3": {},
    "olmo2": {},
    "smollm3": {"no_rope_layer_interval": 2},
    "gpt_oss": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "norm_topk_prob": True},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    # OLMoE normalises q and k over hidden_size, so heads x head_dim must equal it (64 = 2 x 32).
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 2, "num_key_value_heads": 2},
    # Multi-head latent attention (MLA): query/key heads are nope + rope dims (32 + 16), value heads
    # 32 wide, keys and values from a compressed latent (kv_lora_rank); then routed + shared experts.
    # Mistral 4 ropes a fraction of head_dim = qk_head_dim (48 + 16 here, 16 of them rotated).
    "mistral4": {**_MLA, "qk_nope_head_dim": 48, "head_dim": 64,
                 "rope_parameters": {**_YARN, "partial_rotary_factor": 0.25}, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                 "moe_intermediate_size": 32, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1},
    # topk_method as DeepSeek V3's config.json has it: vLLM reads the router's score-correction bias only then.
    "deepseek_v3": {**_MLA, "topk_method": "noaux_tc", "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    # Hybrid: a Gated DeltaNet linear-attention layer (recurrent + convolution state), then full attention.
    "qwen3_5_text": {**_LINEAR, "layer_types": ["linear_attention", "full_attention"]},
    "qwen3_next": {**_LINEAR, "layer_types": ["linear_attention", "full_attention"], "num_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    "llama4_text": {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 128,
                    "interleave_moe_layer_step": 2, "no_rope_layer_interval": 2, "attention_chunk_size": WINDOW},
    "gemma4_text": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                    "vocab_size_per_layer_input": 272, "hidden_size_per_layer_input": 16},
    "glm4_moe": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                 "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    "ministral3": {"rope_parameters": _YARN},
    "olmo3": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    # DeepSeek V3.2: V3's latent attention plus a lightning indexer keeping each query's top 16 keys
    # (fewer than the test sequences, so the sparse selection bites).
    "deepseek_v32": {**_MLA, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                     "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                     "index_topk": 16, "index_head_dim": 32, "index_n_heads": 8},
    # DeepSeek V4: one shared key/value head with sinks and a sliding window, keys compressed over
    # blocks of 4 (CSA, indexed top 4) or 8 (HCA) positions, hyper-connections, hash-routed then
    # top-k routed experts.
    "deepseek_v4": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
                    "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 48, "o_groups": 2, "o_lora_rank": 32,
                    "index_n_heads": 8, "index_head_dim": 32, "index_topk": 4, "sliding_window": 8, "hc_mult": 2,
                    "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
                    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                    "mlp_layer_types": ["hash_moe", "moe"]},
    "qwen3_5_moe_text": {**_LINEAR, "layer_types": ["linear_attention", "full_attention"], "num_experts": 4,
                         "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    # Kimi Linear: Kimi Delta Attention (linear) layers, then latent attention; routed + shared experts.
    "kimi_linear": {**_MLA, "q_lora_rank": None, "linear_head_dim": 16, "linear_num_heads": 4,
                    "layer_types": ["linear_attention", "full_attention"], "num_local_experts": 4,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1},
}
"""The decoder architectures the test matrix builds (transformers model_type names)."""

QUANTIZED_ROWS: dict[str, tuple[str, str]] = {
    # Mistral 4's shape (latent attention + routed and shared experts) as its release ships it,
    # quantized (NVFP4 there); nf4 is the 4-bit format bitsandbytes runs on a CPU.
    "mistral4_nf4": ("mistral4", "nf4"),
}
"""Further rows of the matrix: LoRA on a quantized base, {row: (architecture, model.quantization)}."""


def build_model(hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0,
                vocab_size: int = 272, max_positions: int = 4096, arch: str = "llama",
                tied: bool = False):  # -> PreTrainedModel
    """A random-init causal LM of architecture `arch` (a key of ARCHITECTURES) at tiny sizes; `tied`:
    the output head shares the token embedding (as SmolLM2's does)."""
    import torch

    from sleuth.system.models import causal_lm_class, config_class

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        # vLLM's CPU attention kernels support head sizes from 32 up, so never go below 32.
        head_dim=max(32, hidden // heads),
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=258,  # <|im_end|>: ids 256, 257, 258 are EOT, IM_START, IM_END
        pad_token_id=256,
    )
    extra = dict(ARCHITECTURES[arch])
    for key in [k for k in extra if k.endswith("layer_types")]:  # layer_types, mlp_layer_types (DeepSeek V4):
        extra[key] = [extra[key][i % len(extra[key])] for i in range(layers)]  # repeated over the layers asked for
    config = config_class(arch)(**{**fields, **extra})  # transformers' own, whatever vLLM registered
    torch.manual_seed(seed)
    model = causal_lm_class(config)._from_config(config)
    # A slightly larger init than the default makes sampled outputs varied instead of near-uniform.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif name.endswith("sinks"):  # GPT-OSS attention sinks: make them matter
                p.normal_(0.0, 1.0)
    return model


def write_tiny_model(out_dir: str | Path, hidden: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, seed: int = 0, arch: str = "llama", tied: bool = False) -> Path:
    """Write model + tokenizer into out_dir (an HF folder transformers and vLLM load). Returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    assert tokenizer.convert_tokens_to_ids(IM_END) == 258, "special token ids moved"
    model = build_model(hidden, layers, heads, kv_heads, seed, arch=arch, tied=tied)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    gen = {"eos_token_id": 258, "pad_token_id": 256}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def write_tiny_wrapped_model(out_dir: str | Path, arch: str = "ministral3", seed: int = 0) -> Path:
    """A tiny vision-language checkpoint as Mistral 3 publishes them (Mistral3ForConditionalGeneration:
    a Pixtral vision tower, a projector, and the language model `arch` inside, saved the way
    transformers saves it), with the tiny tokenizer. Returns out_dir."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = build_model(arch=arch, seed=seed).config.to_dict()
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "head_dim": 16, "image_size": 64, "patch_size": 16}
    config = AutoConfig.for_model("mistral3", text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    out = Path(out_dir)
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 258, "pad_token_id": 256}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHITECTURES))
    a = parser.parse_args()
    print(write_tiny_model(a.out_dir, a.hidden, a.layers, a.heads, a.kv_heads, a.seed, a.arch))


if __name__ == "__main__":
    main()
