"""LoRA on a bf16 base without float32 copies of its inputs kept for backward.

    keep_inputs_in_base_dtype(peft_model)     # once, after get_peft_model

With float32 adapters on a bf16 base (model.lora.dtype=float32, the default), PEFT casts each
adapted layer's input to float32 before lora_A, and autograd keeps that float32 copy for lora_A's
weight gradient: one per adapted layer (q, k, v, o, gate, up, down: seven per decoder layer, even
where q, k and v read the same tensor). Measured on the default's SmolLM2 row of 1,342 tokens they
were 0.85 of the 1.8 GB that a training step keeps for backward (docs/benchmarks.md, "memory").

Here lora_A takes the bf16 input itself and upcasts it inside one autograd function that keeps
the bf16 tensor (shared by layers reading the same input) and upcasts it again in backward. The
arithmetic is PEFT's: the same float32 product forward, the same float32 weight gradient, the
input gradient cast back to the input's dtype as the cast's backward would; only what is stored
between forward and backward changes. Layers with dropout (a mask drawn on the float32 input) or
a LoRA variant (DoRA) keep PEFT's path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class _UpcastLinearFn(torch.autograd.Function):
    """y = x.to(W.dtype) @ W.T, keeping x in its own dtype for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x.to(weight.dtype), weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = (grad @ weight).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = grad.reshape(-1, grad.shape[-1]).T @ x.reshape(-1, x.shape[-1]).to(weight.dtype)
        return grad_x, grad_w


class UpcastLinear(torch.nn.Linear):
    """lora_A that accepts its input in any float dtype (no bias: LoRA's A never has one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _UpcastLinearFn.apply(x, self.weight)


def keep_inputs_in_base_dtype(model: Any) -> int:
    """Switch every plain LoRA linear layer of `model` whose adapter dtype differs from its input's
    to the upcast-inside path; returns how many were switched."""
    from peft.tuners.lora import Linear as LoraLinear

    switched = 0
    for module in model.modules():
        if not isinstance(module, LoraLinear) or module.lora_variant:
            continue
        base_dtype = module.get_base_layer().weight.dtype
        adapters = [(module.lora_A[name], module.lora_dropout[name]) for name in module.lora_A]
        if not adapters or any(not isinstance(drop, torch.nn.Identity) or a.bias is not None
                               or a.weight.dtype == base_dtype or not base_dtype.is_floating_point
                               for a, drop in adapters):
            continue
        module.cast_input_dtype_enabled = False  # PEFT's own switch: lora_A receives the bf16 input
        for a, _ in adapters:
            a.__class__ = UpcastLinear
        switched += 1
    return switched
