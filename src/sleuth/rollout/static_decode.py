"""Decode steps with fixed shapes and no host work, so that a GPU step can be one CUDA graph replay.

Measured on an H200 (issue 17): the transformers engine's decode step launched ~585 kernels and
synchronised with the host ~22 times per token, keeping the GPU busy ~20% of the time, and the
repeated KV cache grew by `torch.cat` every step. Two changes remove that:

- `StaticSharedCache`: the shared-prompt cache of shared_prefix.py with every buffer allocated up
  front (each row's own-token slots for the whole completion budget) and written at a step counter
  that lives on the device. Attention covers all slots with an additive mask computed on the
  device from that counter, so every decode step has the same shapes and no Python-side state.
- `DecodeGraph`: one decode forward captured as a CUDA graph for a fixed set of rows; each step
  copies the new tokens and positions into its static inputs and replays it (one launch). When
  enough rows have finished the engine compacts the cache and captures a graph for the survivors.

On a CPU there is nothing to capture: `DecodeGraph` runs the same forward eagerly, which is how
the tests check that static decoding equals the growing-cache decoding token for token.
"""

from __future__ import annotations

from typing import Any

import torch

from sleuth.rollout.shared_prefix import SharedPrefixCache

WARMUP_STEPS = 2
"""Eager forwards on a side stream before a capture (CUDA's requirement for cuBLAS workspaces etc.)."""


class StaticSharedCache(SharedPrefixCache):
    """SharedPrefixCache with own-token slots for all `max_new` tokens allocated at once and a
    device-side step counter: `update` and `attend` do the same work, with the same shapes, at
    every step."""

    def __init__(self, prefix: list[tuple[torch.Tensor, torch.Tensor]], prefix_valid: torch.Tensor,
                 rows_per_group: list[int], max_new: int) -> None:
        super().__init__(prefix, prefix_valid, rows_per_group, max_new)
        k0 = prefix[0][0]
        rows = sum(rows_per_group)
        self.own_k = [torch.zeros((rows, k.shape[1], max_new, k.shape[3]), dtype=k.dtype, device=k.device)
                      for k, _ in prefix]
        self.own_v = [torch.zeros((rows, v.shape[1], max_new, v.shape[3]), dtype=v.dtype, device=v.device)
                      for _, v in prefix]  # values may be narrower than keys (latent attention)
        self.step = torch.zeros(1, dtype=torch.long, device=k0.device)
        """Own tokens stored per row before the current step (its new token goes to this slot)."""
        self._slots = torch.arange(max_new, device=k0.device)
        self.own_bias = torch.zeros(max_new, dtype=torch.float32, device=k0.device)
        """0 over the slots filled so far (the current step's included), -inf after them."""

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if key.shape[2] != 1:
            raise ValueError("StaticSharedCache takes one token per row per step")
        if layer_idx == 0:  # the step's first layer: the new token's slot becomes visible
            self.own_bias.copy_(torch.where(self._slots <= self.step, 0.0, float("-inf")))
        self.own_k[layer_idx].index_copy_(2, self.step, key)
        self.own_v[layer_idx].index_copy_(2, self.step, value)
        if layer_idx == len(self.own_k) - 1:  # every layer holds the token now
            self.step.add_(1)
            self.length += 1  # host-side count, kept for get_seq_length (not read on replay)
        return self.own_k[layer_idx], self.own_v[layer_idx]

    def own_scores(self, q: torch.Tensor, own_k: torch.Tensor) -> torch.Tensor:
        return q @ own_k.float().transpose(-1, -2) + self.own_bias

    def keep_rows(self, idx: torch.Tensor) -> None:
        super().keep_rows(idx)  # (index_select: new, still full-size, buffers)


class DecodeGraph:
    """One decode forward for a fixed batch of rows: a CUDA graph replay on CUDA, eager elsewhere.

    `run(tokens, positions)` -> logits [rows, vocab] (float32). On CUDA the returned tensor is the
    graph's static output, overwritten by the next replay: read it before calling run again."""

    def __init__(self, model: Any, cache: StaticSharedCache, rows: int, device: torch.device,
                 capture: bool) -> None:
        self.model, self.cache = model, cache
        self.tokens = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        # Any prepared 4D mask makes the model skip building its own; the cache's attend masks.
        self.mask = torch.ones((rows, 1, 1, 1), dtype=torch.bool, device=device)
        self.graph: Any = None
        self.logits: torch.Tensor | None = None
        if capture:
            self._capture(device)

    def _forward(self) -> torch.Tensor:
        out = self.model(input_ids=self.tokens, position_ids=self.positions, past_key_values=self.cache,
                         attention_override=self.cache, attention_mask=self.mask, use_cache=True)
        return out.logits[:, -1].float()

    def _capture(self, device: torch.device) -> None:
        # Warm-up forwards write into the current slot and advance the counter: undo the advance
        # (the slot is overwritten by the real step).
        step0 = self.cache.step.clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._forward()
                self.cache.step.copy_(step0)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()
        self.cache.step.copy_(step0)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens.view(-1, 1))
        self.positions.copy_(positions.view(-1, 1))
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        assert self.logits is not None
        return self.logits
