"""Decoding with each group's prompt cache stored once: attention split into shared prompt + own tokens.

After the prompts are prefilled, the n samples of a group all attend to the same prompt keys and
values. Repeating that cache to n rows (what `generate(num_return_sequences=n)` and a plain
repeated cache do) makes every decode step read, and a growing cache copy, n times the prompt's
KV: on a CPU a 32-row step over 600-token prompts measured ~4x an 8-row step, so batching bought
nothing. Here the prompt KV stays one copy per group and each row's own tokens go into a small
buffer (grown by doubling, never copied per step); one decode step's attention for a row is

    softmax([q.K_prompt | q.K_own]) @ [V_prompt | V_own]

computed as two score blocks merged with a shared maximum (no [rows x prompt] copy ever exists).
Queries of a group's rows are stacked so the prompt block is one matmul per group and KV head.

The cache object implements the small part of the transformers Cache interface that a decoder
forward uses (update, get_seq_length); the attention itself reaches the model's layers through
the `attention_override` forward keyword of sleuth's registered attention (sleuth/system/attention.py).
Inference only (no autograd), decode steps of one token per row only.
"""

from __future__ import annotations

from typing import Any

import torch

INITIAL_SLOTS = 128
"""Own-token slots per row allocated at first (doubled as needed)."""


class SharedPrefixCache:
    """Per layer: the groups' prompt K/V once ([G, Hkv, W, D], left-padded to W) and each row's
    own generated K/V in a buffer of slots ([rows, Hkv, slots, D], grown up to max_new)."""

    is_compileable = False

    def __init__(self, prefix: list[tuple[torch.Tensor, torch.Tensor]], prefix_valid: torch.Tensor,
                 rows_per_group: list[int], max_new: int) -> None:
        self.prefix_k = [k.float() for k, _ in prefix]
        self.prefix_v = [v.float() for _, v in prefix]
        # Additive mask over the prompt keys: -inf on left padding, 0 elsewhere ([G, 1, W]).
        self.prefix_bias = torch.zeros(prefix_valid.shape, dtype=torch.float32, device=prefix_valid.device)
        self.prefix_bias.masked_fill_(~prefix_valid.bool(), float("-inf"))
        self.prefix_bias = self.prefix_bias[:, None, :]
        rows = sum(rows_per_group)
        # Slots grow by doubling (from INITIAL_SLOTS) up to max_new, so a long max_tokens costs
        # memory only when samples actually run long.
        self.max_new = max_new
        # Keys and values may differ in width (latent attention: value heads != query/key heads).
        slots = min(max_new, INITIAL_SLOTS)
        self.own_k = [torch.empty((rows, k.shape[1], slots, k.shape[3]), dtype=k.dtype, device=k.device)
                      for k, _ in prefix]
        self.own_v = [torch.empty((rows, v.shape[1], slots, v.shape[3]), dtype=v.dtype, device=v.device)
                      for _, v in prefix]
        self.row_group = torch.repeat_interleave(torch.arange(len(rows_per_group)), torch.tensor(rows_per_group))
        self.length = 0  # own tokens stored per row (the same for every row: they decode in step)
        self._spans = self._group_spans()

    # ------------------------------------------------------------ the Cache interface used

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one new token per row; returns the rows' own keys/values so far (views)."""
        if key.shape[2] != 1:
            raise ValueError("SharedPrefixCache takes one token per row per step")
        t = self.length
        if t == self.own_k[layer_idx].shape[2]:
            if t >= self.max_new:
                raise ValueError(f"SharedPrefixCache holds at most {self.max_new} new tokens per row")
            self.own_k[layer_idx] = _grown(self.own_k[layer_idx], min(2 * t, self.max_new))
            self.own_v[layer_idx] = _grown(self.own_v[layer_idx], min(2 * t, self.max_new))
        self.own_k[layer_idx][:, :, t] = key[:, :, 0]
        self.own_v[layer_idx][:, :, t] = value[:, :, 0]
        if layer_idx == len(self.own_k) - 1:  # the step's last layer: every layer has the token now
            self.length = t + 1
        return self.own_k[layer_idx][:, :, : t + 1], self.own_v[layer_idx][:, :, : t + 1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.prefix_k[0].shape[2]) + self.length

    # ------------------------------------------------------------ rows

    def keep_rows(self, idx: torch.Tensor) -> None:
        """Keep only the rows at `idx` (sorted), e.g. after some finished."""
        self.own_k = [k[idx] for k in self.own_k]
        self.own_v = [v[idx] for v in self.own_v]
        self.row_group = self.row_group[idx.cpu()]
        self._spans = self._group_spans()

    def _group_spans(self) -> list[tuple[int, int, int]]:
        """(group, first row, end row) of each run of rows of one group (rows stay group-major)."""
        groups = self.row_group.tolist()
        spans, start = [], 0
        for i in range(1, len(groups) + 1):
            if i == len(groups) or groups[i] != groups[start]:
                spans.append((groups[start], start, i))
                start = i
        return spans

    # ------------------------------------------------------------ attention

    def _prefix(self, layer: int, module: torch.nn.Module, own_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's prompt keys and values. A latent-attention layer (Mistral 4, DeepSeek V3)
        caches the compressed latent and its rope part instead of per-head keys and values, and
        expands them (`expand_kv`) after reading the cache: its prompt is expanded once, here."""
        pk, pv = self.prefix_k[layer], self.prefix_v[layer]
        if pk.shape[1] != own_k.shape[1] or pk.shape[3] != own_k.shape[3]:
            if not hasattr(module, "expand_kv"):
                raise ValueError(f"layer {layer}: cached keys {tuple(pk.shape)} do not match the attention's "
                                 f"{tuple(own_k.shape)} and the layer has no expand_kv")
            pk, pv = self.prefix_k[layer], self.prefix_v[layer] = _expanded(module, pk, pv)
        return pk, pv

    def own_scores(self, q: torch.Tensor, own_k: torch.Tensor) -> torch.Tensor:
        """Scores of the rows' queries against their own tokens so far."""
        return q @ own_k.float().transpose(-1, -2)

    def attend(self, module: torch.nn.Module, query: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor,
               scaling: float | None) -> tuple[torch.Tensor, None]:
        """Attention output [rows, 1, Hq, Dv] (transformers' layout) for one decode step."""
        layer = int(module.layer_idx)
        rows, hq, _, d = query.shape
        hkv, dv = own_k.shape[1], own_v.shape[3]
        rep = hq // hkv
        scale = scaling if scaling is not None else d ** -0.5
        # Query heads grouped by their KV head: [rows, Hkv, rep, D], in float32 for the scores.
        q = query.float().reshape(rows, hkv, rep, d) * scale
        own_scores = self.own_scores(q, own_k)  # [rows, Hkv, rep, t]
        out = torch.empty((rows, hkv, rep, dv), dtype=torch.float32, device=query.device)
        pk, pv = self._prefix(layer, module, own_k)
        bias = self.prefix_bias
        for g, a, b in self._spans:
            n = b - a
            qg = q[a:b].permute(1, 0, 2, 3).reshape(hkv, n * rep, d)  # [Hkv, n*rep, D]
            ps = torch.baddbmm(bias[g].expand(hkv, 1, -1), qg, pk[g].transpose(-1, -2))  # [Hkv, n*rep, W]
            os_ = own_scores[a:b].permute(1, 0, 2, 3).reshape(hkv, n * rep, -1)  # [Hkv, n*rep, t]
            m = torch.maximum(ps.amax(-1, keepdim=True), os_.amax(-1, keepdim=True))
            pe, oe = (ps - m).exp_(), (os_ - m).exp_()
            total = pe.sum(-1, keepdim=True) + oe.sum(-1, keepdim=True)
            ov = own_v[a:b].float().permute(1, 0, 2, 3)  # [Hkv, n, t, D]
            own_part = (oe.reshape(hkv, n, rep, -1) @ ov).reshape(hkv, n * rep, dv)
            res = (torch.baddbmm(own_part, pe, pv[g]) / total).reshape(hkv, n, rep, dv)
            out[a:b] = res.permute(1, 0, 2, 3)
        return out.reshape(rows, 1, hq, dv).to(query.dtype), None


def _expanded(module: torch.nn.Module, latent: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A latent-attention layer's cached latents expanded into per-head keys and values (float32)."""
    dtype = next(module.parameters()).dtype
    k, v = module.expand_kv(latent.to(dtype), rope.to(dtype))
    return k.float(), v.float()


def _grown(buf: torch.Tensor, slots: int) -> torch.Tensor:
    out = torch.empty((*buf.shape[:2], slots, buf.shape[3]), dtype=buf.dtype, device=buf.device)
    out[:, :, : buf.shape[2]] = buf
    return out
