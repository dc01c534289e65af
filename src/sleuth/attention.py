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
    return found


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, packed_layout: Any = None,
                             attention_override: Any = None, sliding_window: int | None = None,
                             s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: structured packed attention, or plain sdpa without a layout.

    `attention_override` (a forward keyword, like packed_layout): an object whose
    attend(module, query, key, value, scaling) computes the attention instead; the rollout engine's
    shared-prompt decoding uses it (rollout/shared_prefix.py). `sliding_window` and `s_aux` (sink
    logits) come from the layer itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_override is not None:
        return attention_override.attend(module, query, key, value, scaling)
    if packed_layout is None:
        if s_aux is None:  # transformers' mask already holds causality, padding and the window
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        if attention_mask is None:  # sdpa_mask left out a plain causal mask
            attention_mask = _causal_mask(query.shape[2], key.shape[2], sliding_window, query.device)
        return _dense_attention(module, query, key, value, attention_mask, dropout, scaling, s_aux)
    if query.shape[0] != 1:
        raise ValueError("packed attention takes one row per forward pass")
    window_bites = sliding_window is not None and int(packed_layout.position_ids.max()) >= sliding_window
    if dropout > 0 or query.device.type != "cpu" or window_bites or s_aux is not None:
        # The structured path calls the CPU flash kernels and has no dropout, window or sinks; the
        # dense mask (exact, O(T^2)) covers the rest. (CUDA training uses flex_attention unless the
        # model has windows or sinks, see train/attention.py's backend_for.)
        mask = dense_mask(packed_layout.scope_end.to(query.device), packed_layout.position_ids.to(query.device),
                          sliding_window)
        if s_aux is not None:
            return _dense_attention(module, query, key, value, mask, dropout, scaling, s_aux)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    return packed_layout.attend(query, key, value, scaling), None


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
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED, packed_attention_forward)
    AttentionMaskInterface.register(PACKED, sdpa_mask)
    _registered = True


def dense_mask(scope_end: torch.Tensor, position_ids: torch.Tensor | None = None,
               window: int | None = None) -> torch.Tensor:
    """[1, 1, T, T] boolean mask, True where query (row) may attend key (column); with a sliding
    window, keys `window` or more positions (in the sequence, not the row) back are dropped."""
    idx = torch.arange(scope_end.numel(), device=scope_end.device)
    mask = (idx[None, :] <= idx[:, None]) & (idx[:, None] < scope_end[None, :])
    if window is not None and position_ids is not None:
        mask &= position_ids[:, None] - position_ids[None, :] < window
    return mask[None, None]
