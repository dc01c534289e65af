"""A frozen 4-bit (NF4) token embedding that also serves as a tied output head.

    quantize_embeddings(lm, dtype)      # model.quantization=nf4: after bitsandbytes has loaded lm

bitsandbytes quantizes `nn.Linear` layers only, so a model whose output head is tied to its token
embedding (SmolLM2, Llama 3.2, Qwen2.5 up to 3B, Gemma) keeps that table in 16 bits: for SmolLM2
it is 21% of the parameters and held its nf4 weights at 41% of bf16. This stores the table as 4-bit
NormalFloat codes (the 16 levels of QLoRA's NF4 data type, two per byte) with one float32 absmax
per block of up to 64 values inside a row, so that a lookup reads only the rows it needs. The head
dequantizes the whole table for each call (the chunked logprobs convert it to float32 anyway).

Frozen: LoRA never trains an embedding here, and the reference policy is the same table.
`NF4Embedding.dequantize()` is what weight sync and export send (`Policy.sync_state`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)
"""The NF4 code book (Dettmers et al., QLoRA, 2023): quantiles of a unit normal, scaled to [-1, 1]."""

ROWS_PER_CHUNK = 4096
"""Rows quantized or dequantized at a time: bounds the float32 temporaries to a few MB."""


def block_size(dim: int) -> int | None:
    """The largest of 64, 32, 16, 8 that divides a row (so no block straddles two rows)."""
    return next((b for b in (64, 32, 16, 8) if dim % b == 0), None)


class NF4Embedding(torch.nn.Module):
    """nn.Embedding's forward over a 4-bit table (buffers, no parameters: it is frozen)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        rows, dim = weight.shape
        block = block_size(dim)
        if block is None:
            raise ValueError(f"embedding width {dim} is not a multiple of 8")
        self.num_embeddings, self.embedding_dim, self.block, self.dtype = rows, dim, block, dtype
        levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=weight.device)
        self.register_buffer("levels", levels, persistent=False)
        codes = torch.empty(rows, dim // 2, dtype=torch.uint8, device=weight.device)
        absmax = torch.empty(rows, dim // block, dtype=torch.float32, device=weight.device)
        bounds = (levels[1:] + levels[:-1]) / 2  # nearest level = how many midpoints lie below
        for s in range(0, rows, ROWS_PER_CHUNK):
            w = weight[s : s + ROWS_PER_CHUNK].detach().float().reshape(-1, dim // block, block)
            scale = w.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny)
            idx = torch.bucketize((w / scale[..., None]).reshape(w.shape[0], dim), bounds).to(torch.uint8)
            codes[s : s + ROWS_PER_CHUNK] = idx[:, 0::2] | (idx[:, 1::2] << 4)
            absmax[s : s + ROWS_PER_CHUNK] = scale
        self.register_buffer("codes", codes)
        self.register_buffer("absmax", absmax)

    def _rows(self, codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        """Dequantize packed rows [..., dim/2] with their scales [..., dim/block] -> [..., dim]."""
        idx = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2).long()
        values = self.levels[idx].unflatten(-1, (-1, self.block)) * absmax[..., None]
        return values.flatten(-2).to(self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._rows(self.codes[input_ids], self.absmax[input_ids])

    def dequantize(self) -> torch.Tensor:
        """The whole table [rows, dim] in the compute dtype."""
        out = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.dtype, device=self.codes.device)
        for s in range(0, self.num_embeddings, ROWS_PER_CHUNK):
            out[s : s + ROWS_PER_CHUNK] = self._rows(self.codes[s : s + ROWS_PER_CHUNK],
                                                     self.absmax[s : s + ROWS_PER_CHUNK])
        return out

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized table (a new tensor each time; for code that reads `.weight`)."""
        return self.dequantize()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, nf4, block={self.block}"


class TiedNF4Head(torch.nn.Module):
    """The output head tied to an NF4Embedding: logits = hidden @ table.T, no bias."""

    bias = None

    def __init__(self, embedding: NF4Embedding) -> None:
        super().__init__()
        # Not registered as a submodule: the table belongs to the body (one copy in the module tree,
        # in state dicts and in memory counts); .to() on the whole model moves it there.
        self.__dict__["embedding"] = embedding

    @property
    def weight(self) -> torch.Tensor:
        return self.__dict__["embedding"].dequantize()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight.to(hidden.dtype).T


def quantize_embeddings(lm: Any, dtype: torch.dtype) -> bool:
    """Replace lm's token embedding with an NF4Embedding (and a tied head with TiedNF4Head).

    Only a plain nn.Embedding is replaced (scaled embeddings such as Gemma's multiply in their own
    forward); returns whether it was. An untied head is left to bitsandbytes' choice.
    """
    embed = lm.get_input_embeddings()
    head = lm.get_output_embeddings()
    if type(embed) is not torch.nn.Embedding or block_size(embed.embedding_dim) is None:
        log.warning("model.quantization=nf4: the %s token embedding stays unquantized", type(embed).__name__)
        return False
    tied = head is not None and getattr(head, "weight", None) is not None and head.weight is embed.weight
    quantized = NF4Embedding(embed.weight, dtype)
    lm.set_input_embeddings(quantized)
    if tied:
        lm.set_output_embeddings(TiedNF4Head(quantized))
    return True
