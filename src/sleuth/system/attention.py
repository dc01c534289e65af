"""Attention that transformers models run with inside sleuth: one function registered as the
attn_implementation "sleuth_packed", used by the training stage (packed rows) and the rollout stage
(shared-prompt decoding) alike, so it lives below both.

It dispatches on the forward keywords the caller passes through the model:

- `attention_override`: an object whose attend(module, query, key, value, scaling) computes the
  attention instead (the transformers engine's shared-prompt decoding, rollout/shared_prefix.py).
- `packed_layout`: a packed row's layout (train/attention.py's RowLayout) with `scope_end`,
  `position_ids` and attend(query, key, value, scaling), its structured CPU kernel. The rule: query i
  may attend key j when j <= i < scope_end[j]. With attention dropout, off the CPU, or where a
  sliding window or attention sinks bite, the exact dense mask from scope_end is used instead.
- neither: plain causal attention, exactly as transformers' "sdpa" (generation, plain batches).

Sliding-window layers (Mistral, Gemma 3, GPT-OSS) and attention sinks (GPT-OSS) change the rule:
a key further back than the window is dropped, and a per-head sink logit joins the softmax's
denominator. Both come from the keyword arguments each layer passes (so hybrid models get each
layer's own rule); a window longer than every sequence in the row changes nothing and keeps the
structured path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

PACKED = "sleuth_packed"
COMPRESSED_LAYERS = ("compressed_sparse_attention", "heavily_compressed_attention")
"""DeepSeek V4's layer types whose keys include compressed entries (one per block of positions)."""


def compressed_attention(config: Any) -> bool:
    """Whether layers append compressed keys to the row's own (DeepSeek V4): their visibility comes
    as an additive bias the layer joins to the mask, so the model's masks are built additive."""
    return any(t in COMPRESSED_LAYERS for t in getattr(config, "layer_types", None) or [])


def special_attention(config: Any) -> list[str]:
    """What in this model's attention the structured kernels (packed rows, shared-prompt decoding)
    do not cover: "sliding window N" and/or "attention sinks". Empty for plain causal attention."""
    found = []
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    uses_window = "sliding_attention" in layer_types or (not layer_types and getattr(config, "use_sliding_window", True))
    if window and uses_window:
        found.append(f"sliding window {window}")
    if getattr(config, "model_type", "") == "gpt_oss":  # the one transformers decoder with sink logits
        found.append("attention sinks")
    if "chunked_attention" in layer_types and getattr(config, "attention_chunk_size", None):
        found.append(f"chunked attention {config.attention_chunk_size}")  # Llama 4
    if compressed_attention(config):  # DeepSeek V4: every layer windowed, with sinks and compressed keys
        found.append(f"compressed attention (sliding window {window}, sinks)")
    if getattr(config, "index_topk", None):  # DeepSeek V3.2 / V4: a lightning indexer picks the keys
        found.append(f"sparse attention (top {config.index_topk} keys)")
    return found


def one_sequence_per_row(config: Any) -> str:
    """Why a packed row must hold one sequence for this model ("" when it may hold several):
    state or key selection that a packed row's mask cannot scope to each sequence."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if linear_attention(config):
        return "linear-attention state restarts per sequence"
    if compressed_attention(config):
        return "compressed attention pools keys over blocks of positions"
    if getattr(config, "index_topk", None):
        return "the sparse-attention indexer ranks every earlier key of the row"
    return ""


def _attention_chunk(module: torch.nn.Module) -> int | None:
    """The layer's attention chunk (Llama 4's chunked layers: a key is visible only from queries in
    the same chunk of attention_chunk_size positions); None for other layers. transformers puts it
    in the mask, which packed rows replace, so it is read from the layer's config here."""
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None) or []
    idx = getattr(module, "layer_idx", None)
    if idx is None or idx >= len(layer_types) or layer_types[idx] != "chunked_attention":
        return None
    return getattr(config, "attention_chunk_size", None)


def linear_attention(config: Any) -> bool:
    """Whether the model has linear-attention layers (Qwen3.5 / Qwen3-Next's Gated DeltaNet, Kimi
    Linear): a recurrent and a convolution state per sequence instead of keys and values, which a
    packed row's mask cannot scope (sleuth packs such a model one sequence per row)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return "linear_attention" in (getattr(config, "layer_types", None) or [])


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, packed_layout: Any = None,
                             attention_override: Any = None, sliding_window: int | None = None,
                             s_aux: torch.Tensor | None = None, indices: torch.Tensor | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: structured packed attention, or plain sdpa without a layout.

    `attention_override` (a forward keyword, like packed_layout): an object whose
    attend(module, query, key, value, scaling) computes the attention instead; the rollout engine's
    shared-prompt decoding uses it (rollout/shared_prefix.py). `sliding_window` and `s_aux` (sink
    logits) come from the layer itself; so does `indices` ([B, S, top-k] key positions per query,
    DeepSeek V3.2's sparse attention), applied as a mask on the dense path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_override is not None:
        return attention_override.attend(module, query, key, value, scaling)
    if indices is not None:
        return _sparse_attention(module, query, key, value, attention_mask, dropout, scaling, packed_layout, indices)
    if packed_layout is None:
        if s_aux is None:  # transformers' mask already holds causality, padding and the window
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        if attention_mask is None:  # sdpa_mask left out a plain causal mask
            attention_mask = _causal_mask(query.shape[2], key.shape[2], sliding_window, query.device)
        return _dense_attention(module, query, key, value, attention_mask, dropout, scaling, s_aux)
    if key.shape[2] != query.shape[2]:
        # Keys beyond the row's tokens (DeepSeek V4's compressed entries): such a model is packed one
        # sequence per row (one_sequence_per_row), where the layer's own mask is the row's.
        return packed_attention_forward(module, query, key, value, attention_mask, dropout, scaling,
                                        sliding_window=sliding_window, s_aux=s_aux, **kwargs)
    if query.shape[0] != 1:
        raise ValueError("packed attention takes one row per forward pass")
    longest = int(packed_layout.position_ids.max())
    window_bites = sliding_window is not None and longest >= sliding_window
    chunk = _attention_chunk(module)
    chunk_bites = chunk is not None and longest >= chunk
    if dropout > 0 or query.device.type != "cpu" or window_bites or chunk_bites or s_aux is not None:
        # The structured path calls the CPU flash kernels and has no dropout, window or sinks; the
        # dense mask (exact, O(T^2)) covers the rest. (CUDA training uses flex_attention unless the
        # model has windows or sinks, see train/attention.py's backend_for.)
        mask = dense_mask(packed_layout.scope_end.to(query.device), packed_layout.position_ids.to(query.device),
                          sliding_window, chunk if chunk_bites else None)
        if s_aux is not None:
            return _dense_attention(module, query, key, value, mask, dropout, scaling, s_aux)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    dq, dv = query.shape[-1], value.shape[-1]
    if dv != dq:  # latent attention (MLA): value heads narrower or wider than query/key
        # The CPU flash kernels take one head width: zero-pad the narrower to a common width and
        # keep the value's columns of the output (zero columns add nothing to scores or outputs).
        width = max(dv, dq)
        query, key, value = (F.pad(t, (0, width - t.shape[-1])) for t in (query, key, value))
        scaling = dq ** -0.5 if scaling is None else scaling
        return packed_layout.attend(query, key, value, scaling)[..., :dv].contiguous(), None
    return packed_layout.attend(query, key, value, scaling), None


def _sparse_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
                      packed_layout: Any, indices: torch.Tensor) -> tuple[torch.Tensor, None]:
    """Attention over the keys the indexer picked for each query (and the causal or packed mask
    allows: a query with fewer visible keys than its top-k picks some masked ones too)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, q_len, k_len = query.shape[0], query.shape[2], key.shape[2]
    picked = torch.zeros((b, q_len, k_len), dtype=torch.bool, device=query.device)
    picked.scatter_(-1, indices.long(), True)
    if packed_layout is not None:
        allowed = dense_mask(packed_layout.scope_end.to(query.device))
    elif attention_mask is None:
        allowed = _causal_mask(q_len, k_len, None, query.device)
    else:
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    mask = allowed[..., -k_len:] & picked[:, None]
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling)


def _causal_mask(q_len: int, k_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[1, 1, q_len, k_len] causal boolean mask, the queries being the last q_len positions."""
    q = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k = torch.arange(k_len, device=device)[None, :]
    mask = k <= q
    if window is not None:
        mask &= q - k < window
    return mask[None, None]


def _dense_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     mask: torch.Tensor, dropout: float, scaling: float | None,
                     sinks: torch.Tensor) -> tuple[torch.Tensor, None]:
    """Softmax attention with a per-head sink logit in the denominator (GPT-OSS), under a boolean
    (or additive) mask; [B, T, H, D] out. Float32 scores; the sink takes probability, no value."""
    rep = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(rep, dim=1) if rep > 1 else t for t in (key, value))
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = (query.float() @ key.float().transpose(-1, -2)) * scale
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    b, h, t, _ = scores.shape
    sink = sinks.float().reshape(1, h, 1, 1).expand(b, h, t, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = probs.to(value.dtype) @ value
    return out.transpose(1, 2).contiguous(), None


_registered = False


def register_packed_attention() -> None:
    """Make attn_implementation="sleuth_packed" known to transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED, packed_attention_forward)
    AttentionMaskInterface.register(PACKED, _packed_mask)
    _registered = True


def _packed_mask(*args: Any, config: Any = None, **kwargs: Any) -> torch.Tensor | None:
    """transformers mask interface: sdpa's boolean masks, or eager's additive ones for a model
    whose layers join additive biases to them (compressed_attention)."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    if config is not None and compressed_attention(config):
        return eager_mask(*args, **kwargs)
    return sdpa_mask(*args, **kwargs)


def dense_mask(scope_end: torch.Tensor, position_ids: torch.Tensor | None = None,
               window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """[1, 1, T, T] boolean mask, True where query (row) may attend key (column); with a sliding
    window, keys `window` or more positions (in the sequence, not the row) back are dropped; with
    an attention chunk, keys outside the query's chunk of positions."""
    idx = torch.arange(scope_end.numel(), device=scope_end.device)
    mask = (idx[None, :] <= idx[:, None]) & (idx[:, None] < scope_end[None, :])
    if window is not None and position_ids is not None:
        mask &= position_ids[:, None] - position_ids[None, :] < window
    if chunk is not None and position_ids is not None:
        mask &= position_ids[:, None] // chunk == position_ids[None, :] // chunk
    return mask[None, None]
